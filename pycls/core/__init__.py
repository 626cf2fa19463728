"""What upstream pycls's core holds, where a pycls user looks for it: the config, the builders
(config -> objects), the trainer and the recipes it calls (optimizer, schedules, EMA, fine-tuning),
meters, logging and ``json_stats``, the benchmark modes (info, time) and the timing every
measurement uses, the learning-rate finder and the command line. The top library layer: it may
import every package but ``pycls.sweep``.
"""
