"""Config sweeps: many runs of one base config, launched with submitit, gathered and plotted.

Four steps, each a tool taking the same sweep file (schema in pycls/sweep/sweep_file.py):

1. ``tools/sweep_setup.py``: one validated pycls config per point (pycls/sweep/setup.py, points
   from pycls/sweep/samplers.py)
2. ``tools/sweep_launch.py``: trains the unfinished runs on SLURM or locally (pycls/sweep/submit.py)
3. ``tools/sweep_collect.py``: every run's json_stats into sweep.json (pycls/sweep/collect.py)
4. ``tools/sweep_analyze.py``: markdown table and PNG plots (pycls/sweep/analyze.py)

Nothing is imported here, so ``import pycls.sweep`` pulls in neither submitit nor matplotlib.
"""
