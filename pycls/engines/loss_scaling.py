"""Loss scaling that agrees across processes holding different gradients (shards, stages)."""

from pycls import distributed as dist
from pycls.engines.precision import DynamicLossScaler


class AgreeingLossScaler(DynamicLossScaler):
    """Dynamic loss scaling whose inf/NaN check is the maximum over all processes.

    Each process sees only its own gradients (a shard, a stage); without agreement one process
    would skip a step that another takes.
    """

    @classmethod
    def for_precision(cls, precision, device):
        """The AMP level's scaler, agreeing when it scales dynamically (float16)."""
        scaler = precision.make_scaler(device)
        return cls(device) if isinstance(scaler, DynamicLossScaler) else scaler

    def unscale_(self, optimizer):
        if self._unscaled:
            return
        super().unscale_(optimizer)
        dist.all_reduce_max(self._found_inf)
