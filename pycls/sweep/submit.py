"""Sweep launch: trains every unfinished run with submitit, on SLURM or on this machine.

Each run is one submitit job that trains in-process (``pycls.core.cli.run_mode("train", cfg)``
through ``pycls.distributed.launch``), with TRAIN.AUTO_RESUME on. The job object has a
``checkpoint``
method, which makes it checkpointable for submitit: when SLURM preempts the job or it reaches its
time limit, submitit calls ``checkpoint``, requeues the same job, and the requeued run resumes from
its last checkpoint in OUT_DIR.

- ``LAUNCH.MODE slurm``: one job array (at most MAX_PARALLEL jobs running), one task per GPU;
  SLURM starts the processes, so each task trains as one rank (RANK, WORLD_SIZE, MASTER_ADDR, ...
  exported from submitit's environment) and the config's NUM_PROCS is set to 1. Returns once the
  jobs are queued unless LAUNCH.WAIT.
- ``LAUNCH.MODE local``: submitit's LocalExecutor, MAX_PARALLEL runs at a time; waits for all.

Finished runs are skipped (see pycls/sweep/runs.py), as are runs whose SLURM job is still queued
or running and runs whose OUT_DIR lock a live process holds (reported as running). A run that
fails is reported with its log, traceback and submitit stderr paths and does not stop the others.
One launcher at a time per sweep: it holds ``launch/launcher.lock`` while it submits (and, locally,
while its runs train); a second one is refused naming the first.
"""

import os
import time
import traceback

import torch

from pycls import config
from pycls.checkpoint.run_lock import RunLock, RunLockedError, live_holder
from pycls.core import builders
from pycls.core.cli import run_mode
from pycls.distributed.launch import launch
from pycls.sweep import cli
from pycls.sweep.commands import step_command
from pycls.sweep.runs import (
    ERROR_FILE,
    SweepError,
    is_finished,
    list_runs,
    load_job_records,
    save_job_records,
)
from pycls.sweep.sweep_file import launch_dir

# SLURM states of a job that may still write to its run's OUT_DIR
_ACTIVE_STATES = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING", "COMPLETING"}
_ACTIVE_STATES |= {"RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT"}
_POLL_S = 0.5


def import_submitit():
    try:
        import submitit  # imported only by the sweep launcher, which alone needs it
    except ImportError:
        raise SweepError(
            "launching a sweep needs submitit: pip install submitit (it is in pycls' setup.py)"
        ) from None
    return submitit


class TrainJob:
    """A submitit job that trains one sweep run; requeued (and resumed) on preemption."""

    def __init__(self, cfg_file, num_tasks=1, num_threads=0):
        self.cfg_file = cfg_file
        self.num_tasks = num_tasks
        self.num_threads = num_threads  # CPU threads of this run's torch (0 = torch's default)

    def __call__(self):
        overrides = ["TRAIN.AUTO_RESUME", True]
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        if self.num_tasks > 1:  # SLURM made the processes: this task is one rank
            import_submitit().helpers.TorchDistributedEnvironment().export(
                set_cuda_visible_devices=False
            )
            overrides += ["NUM_PROCS", 1]
        cfg = config.load_cfg(self.cfg_file, overrides)
        error_file = os.path.join(cfg.OUT_DIR, ERROR_FILE)
        is_main = os.environ.get("RANK", "0") == "0"
        try:
            stats = launch(run_mode, builders.launch_settings(cfg), "train", cfg)
        except Exception as e:  # not SystemExit: submitit exits that way after requeueing
            # A run locked by another process is that process's, healthy: nothing to write there
            if is_main and not isinstance(e, RunLockedError):
                os.makedirs(cfg.OUT_DIR, exist_ok=True)
                with open(error_file, "w") as f:
                    f.write(traceback.format_exc())
            raise
        return {k: v for k, v in (stats or {}).items() if isinstance(v, (int, float, str))}

    def checkpoint(self, *args, **kwargs):
        """Called by submitit on preemption or timeout: resubmit this job unchanged; the trainer
        resumes from the newest checkpoint (TRAIN.AUTO_RESUME)."""
        return import_submitit().helpers.DelayedSubmission(self, *args, **kwargs)


# ------------------------------------------------------------------------------------------------ #
# Executors
# ------------------------------------------------------------------------------------------------ #


def executor_parameters(sc):
    """submitit AutoExecutor parameters for the sweep's LAUNCH settings."""
    la = sc.LAUNCH
    params = dict(name=f"pycls_{sc.NAME}", timeout_min=la.TIME_LIMIT_MIN)
    if la.MODE == "local":
        return dict(params, tasks_per_node=1, gpus_per_node=la.GPUS_PER_NODE)
    params.update(
        nodes=la.NODES, tasks_per_node=max(la.GPUS_PER_NODE, 1), cpus_per_task=la.CPUS_PER_TASK
    )
    optional = {
        "gpus_per_node": la.GPUS_PER_NODE,
        "mem_gb": la.MEM_GB,
        "slurm_partition": la.PARTITION,
        "slurm_comment": la.COMMENT,
        "slurm_constraint": la.CONSTRAINT,
        "slurm_account": la.ACCOUNT,
        "slurm_array_parallelism": la.MAX_PARALLEL,
    }
    params.update({k: v for k, v in optional.items() if v})
    return params


def make_executor(sc):
    submitit = import_submitit()
    cluster = sc.LAUNCH.MODE
    folder = os.path.join(launch_dir(sc), "submitit")
    timeouts = {f"{cluster}_max_num_timeout": sc.LAUNCH.MAX_REQUEUE}
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster, **timeouts)
    executor.update_parameters(**executor_parameters(sc))
    return executor


def num_tasks(sc):
    """Training processes SLURM starts per run (one per GPU); locally the run spawns its own."""
    la = sc.LAUNCH
    return la.NODES * max(la.GPUS_PER_NODE, 1) if la.MODE == "slurm" else 1


# ------------------------------------------------------------------------------------------------ #
# Job records (launch/jobs.json, see pycls/sweep/runs.py)
# ------------------------------------------------------------------------------------------------ #


def _job_record(sc, job):
    return {
        "job_id": str(job.job_id),
        "mode": sc.LAUNCH.MODE,
        "stdout": str(job.paths.stdout),
        "stderr": str(job.paths.stderr),
        "submitted": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _active_slurm_state(sc, record):
    """The SLURM state of a run's last job if it is still queued or running, else None."""
    if not record or record.get("mode") != "slurm":
        return None
    submitit = import_submitit()
    try:
        folder = os.path.join(launch_dir(sc), "submitit")
        state = submitit.SlurmJob(folder=folder, job_id=record["job_id"]).state
    except Exception as e:  # sacct missing or failing: submitting again is the lesser evil
        print(f"warning: cannot read the state of job {record['job_id']}: {e}")
        return None
    return state if state.split()[0] in _ACTIVE_STATES else None


# ------------------------------------------------------------------------------------------------ #
# Launching
# ------------------------------------------------------------------------------------------------ #


def runs_to_launch(sc, runs, records):
    """(to_launch, skipped): unfinished runs, and {name: reason} for those left alone."""
    todo, skipped = [], {}
    for run in runs:
        if is_finished(run):
            skipped[run.name] = "finished"
        elif state := _active_slurm_state(sc, records.get(run.name)):
            skipped[run.name] = f"job {records[run.name]['job_id']} is {state}"
        elif holder := live_holder(run.out_dir):
            skipped[run.name] = f"running (its OUT_DIR is locked by {holder})"
        else:
            todo.append(run)
    return todo, skipped


def _submit_one(executor, run, job):
    if os.path.exists(run.error_file):
        os.remove(run.error_file)
    return executor.submit(job)


def _run_local(sc, executor, runs, records):
    """Runs at most MAX_PARALLEL jobs at a time, each slot on its own GPUs (or its share of the
    CPU cores, so parallel CPU runs do not oversubscribe them); waits for all."""
    slots = sc.LAUNCH.MAX_PARALLEL or len(runs)
    g = sc.LAUNCH.GPUS_PER_NODE
    threads = 0 if g or slots == 1 else max(1, (os.cpu_count() or 1) // slots)
    free, pending, active, jobs, outcome = list(range(slots)), list(runs), {}, {}, {}
    by_slot = {}
    while pending or active:
        while pending and free:
            slot, run = free.pop(0), pending.pop(0)
            if g:
                executor.update_parameters(local_visible_gpus=tuple(range(slot * g, slot * g + g)))
            job = _submit_one(executor, run, TrainJob(run.cfg_file, num_threads=threads))
            jobs[run.name] = active[slot] = job
            by_slot[slot] = run
            records[run.name] = _job_record(sc, job)
            save_job_records(sc, records)
            print(f"started {run.name} (job {job.job_id})", flush=True)
        time.sleep(_POLL_S)
        for slot, job in list(active.items()):
            if job.done():  # reported as it ends, before the next run in its slot starts
                del active[slot]
                free.append(slot)
                run = by_slot.pop(slot)
                outcome[run.name] = report_one(run, job, records)
    return jobs, outcome


def _submit_slurm(sc, executor, runs, records):
    n_tasks = num_tasks(sc)
    with executor.batch():
        jobs = [_submit_one(executor, run, TrainJob(run.cfg_file, n_tasks)) for run in runs]
    for run, job in zip(runs, jobs):
        records[run.name] = _job_record(sc, job)
        print(f"queued {run.name} as SLURM job {job.job_id}")
    save_job_records(sc, records)
    return dict(zip((run.name for run in runs), jobs))


def _wait(jobs):
    while not all(job.done() for job in jobs.values()):
        time.sleep(10 * _POLL_S)


def _failure_message(run, job):
    msg = run.error_message()
    if msg:
        return msg
    exc = job.exception()
    if exc is not None:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return lines[-1] if lines else type(exc).__name__
    return "the job ended before the last epoch was evaluated"


def report(runs, jobs, records):
    """{name: None if finished, else the failure message}; prints each failure with its paths."""
    return {run.name: report_one(run, jobs[run.name], records) for run in runs if run.name in jobs}


def report_one(run, job, records):
    """None if the run finished, else its failure message, printed with its paths."""
    if is_finished(run):
        print(f"done   {run.name}  {run.out_dir}", flush=True)
        return None
    msg = _failure_message(run, job)
    print(f"FAILED {run.name}: {msg}")
    print(f"         log:    {run.log_file}")
    if os.path.isfile(run.error_file):
        print(f"         error:  {run.error_file}")
    print(f"         stderr: {records[run.name]['stderr']}", flush=True)
    return msg


LAUNCHER_LOCK = "launcher.lock"


def launch_sweep(sc, dry_run=False):
    """Launches the unfinished runs; returns {"skipped": {name: why}, "launched": [names],
    "failed": {name: message}} (failures are known only once the runs have ended). Refused
    (SweepError) while another launcher works on the same sweep."""
    if dry_run:
        return _launch_sweep(sc, dry_run)
    lock = RunLock(
        launch_dir(sc),
        LAUNCHER_LOCK,
        busy=f"sweep {sc.NAME} is being launched by another sweep_launch.py",
        hint="Wait for it (sweep_collect.py shows the runs), or, if it is gone, remove {path}",
    )
    try:
        lock.acquire()
    except RunLockedError as e:
        raise SweepError(str(e)) from None
    try:
        return _launch_sweep(sc, dry_run)
    finally:
        lock.release()


def _launch_sweep(sc, dry_run):
    runs = list_runs(sc)
    records = load_job_records(sc)
    todo, skipped = runs_to_launch(sc, runs, records)
    for name, why in skipped.items():
        print(f"skip   {name}: {why}")
    result = {"skipped": skipped, "launched": [r.name for r in todo], "failed": {}}
    if dry_run or not todo:
        print(f"{'would launch' if dry_run else 'nothing to launch'}: {result['launched']}")
        return result
    _export_repo_path()
    executor = make_executor(sc)
    if sc.LAUNCH.MODE == "local":
        _, outcome = _run_local(sc, executor, todo, records)
    else:
        jobs = _submit_slurm(sc, executor, todo, records)
        if not sc.LAUNCH.WAIT:
            print(f"jobs queued; {step_command('collect')} reports their status")
            return result
        _wait(jobs)
        outcome = report(runs, jobs, records)
    result["failed"] = {name: msg for name, msg in outcome.items() if msg is not None}
    return result


def _export_repo_path():
    """Jobs are fresh interpreters: let them import this pycls even when it is not installed."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if repo not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in paths if p])


def _add_args(parser):
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would be launched or skipped, start none"
    )


def _run(sc, args):
    result = launch_sweep(sc, dry_run=args.dry_run)
    n_failed = len(result["failed"])
    if n_failed:
        print(f"{n_failed} of {len(result['launched'])} launched runs failed")
    return 1 if n_failed else 0


def main(argv=None, prog=None):
    return cli.run_tool(
        "Train the runs of a sweep with submitit (SLURM or local).",
        _run,
        argv,
        _add_args,
        prog=prog,
    )
