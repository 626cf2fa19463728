"""What upstream pycls's core holds, where a pycls user looks for it: the builders (config ->
objects: ``builders``), the trainer and the recipes it calls (schedules, EMA, distillation,
fine-tuning), the one training step, meters, logging and ``json_stats``, the benchmark modes (info,
time) and the timing every measurement uses, the learning-rate finder, the exports and the command
line. The config itself lives in ``pycls.config`` and the optimizers in ``pycls.optim``; the
modules ``config`` and ``optimizer`` here are re-export shims at upstream pycls's paths. The top
library layer: it may import every package but ``pycls.sweep``.
"""
