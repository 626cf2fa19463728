"""How the user runs each sweep step, for the messages that name the next one: ``pycls
sweep-STEP`` (or ``python -m pycls sweep-STEP``) where the step at hand was run so (from a wheel
there is no tools/ folder), ``python tools/sweep_STEP.py`` where it was run from a checkout's
tools/. ``pycls.sweep.cli.run_tool`` records which at the start of every step.
"""

# The command of the step at hand ("pycls sweep-setup", "python -m pycls sweep-collect"), or None
# for a script of tools/
_INVOKED = {"prog": None}


def invoked_as(prog):
    """Records how the step at hand was run: its ``prog`` (None for tools/sweep_STEP.py)."""
    _INVOKED["prog"] = prog if prog and " sweep-" in prog else None


def step_command(step):
    """The command line of sweep step ``step`` (setup, launch, collect, analyze), as the user
    runs the steps."""
    prog = _INVOKED["prog"]
    if prog is None:
        return f"python tools/sweep_{step}.py"
    return f"{prog.rsplit(' sweep-', 1)[0]} sweep-{step}"
