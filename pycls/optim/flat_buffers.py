"""Parameters, gradients and optimizer state of a group as views into flat buffers.

The storage of the optimizer's contiguous mode (``pycls.optim.optimizers``, ``contiguous=True``):
one flat tensor per (group, device, dtype) and kind (weights, gradients, each state), so that a
fused update is one kernel call over the buffer. Like FSDP's flat parameters, it owns where the
parameters live, which is why it sits with the engines.
"""

import torch


class FlatBuffer:
    """One flat tensor holding same-shaped views of several tensors, in order."""

    def __init__(self, like, dtype, device):
        self.flat = torch.zeros(sum(t.numel() for t in like), dtype=dtype, device=device)
        self.views = views_like(self.flat, like)

    def holds(self, i, tensor):
        """Whether ``tensor`` is (still) the i-th view of this buffer."""
        view = self.views[i]
        return (
            tensor is not None
            and tensor.data_ptr() == view.data_ptr()
            and tensor.shape == view.shape
            and tensor.dtype == view.dtype
        )


def views_like(flat, like):
    """Views of consecutive slices of ``flat`` shaped like the tensors of ``like``."""
    views, offset = [], 0
    for t in like:
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


class Bucket:
    """The parameters of one (group, device, dtype) with their data, grads and state flattened."""

    def __init__(self, group_index, params, state_keys, state_dtype, with_master):
        # The group by index: load_state_dict replaces the group dicts with new ones
        self.group_index, self.params, self.state_dtype = group_index, params, state_dtype
        device, dtype = params[0].device, params[0].dtype
        self.data = FlatBuffer(params, dtype, device)
        self.grads = FlatBuffer(params, dtype, device)
        for p, view in zip(params, self.data.views):
            view.copy_(p.detach())
            p.data = view
        for p, view in zip(params, self.grads.views):
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
        keys = state_keys + (("master",) if with_master else ())
        self.state = {key: FlatBuffer(params, state_dtype, device) for key in keys}

    @property
    def master(self):
        return self.state.get("master")

    def adopt_state(self, state):
        """Copies per-parameter state tensors into the flat buffers and rebinds them as views.

        A missing moment starts at zero and a missing master at the parameter's value. All
        parameters of a bucket share one step count (the largest loaded one), because the update
        runs on the whole buffer at once.
        """
        for key, buf in self.state.items():
            for p, view in zip(self.params, buf.views):
                value = state[p].get(key)
                if value is None and key == "master":
                    view.copy_(p.detach())
                elif value is None:
                    view.zero_()
                elif value is not view:
                    view.copy_(value)
                state[p][key] = view
        step = max((float(state[p]["step"]) for p in self.params if "step" in state[p]), default=0)
        for p in self.params:
            state[p]["step"] = torch.tensor(float(step))

    def sync_views(self):
        """Rebinds parameters and gradients that something replaced back onto the buffers."""
        for i, p in enumerate(self.params):
            if not self.data.holds(i, p):
                if p.shape != self.data.views[i].shape:
                    raise RuntimeError(
                        f"a parameter of shape {tuple(self.data.views[i].shape)} became "
                        f"{tuple(p.shape)} after the contiguous optimizer was built; call "
                        "rebuild_contiguous() after changing parameter shapes"
                    )
                self.data.views[i].copy_(p.detach())
                p.data = self.data.views[i]
            if not self.grads.holds(i, p.grad):
                view = self.grads.views[i]
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view
