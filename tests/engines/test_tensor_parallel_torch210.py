"""The tensor-parallel plan where the DTensor of torch 2.10 (the oldest setup.py allows) differs
from 2.14's, each emulated here on a one-process mesh by taking away what 2.10 lacks:

- no sharding rule for the bicubic resampling of the position embedding
  (aten._upsample_bicubic2d_aa), which an evaluation at another size than training (TEST.IM_SIZE
  != TRAIN.IM_SIZE) reaches: the mesh's first evaluation failed after a whole epoch. The plan
  resamples each process's whole copy of the replicated table itself;
- no strategy for the convolution's backward but an older rule, which marks the weight's and
  bias's gradients partial whatever the input: the replicated stem's gradients were summed over
  the processes, tp times too large. The plan runs the stem's convolution on the local tensors.

(A third difference, strided memory where uneven sequence shards of a batch-first sequence are
gathered, needs several processes of 2.10 itself; the mesh tests of test_tensor_parallel.py,
run on torch 2.10, cover it.)"""

import contextlib

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from pycls.models import VisionTransformer
from pycls.models.vit.tensor_plan import parallelize_vit

BICUBIC = torch.ops.aten._upsample_bicubic2d_aa.default
CONV_BACKWARD = torch.ops.aten.convolution_backward.default
# Where DTensor keeps the strategies newer than torch 2.10's rules
_STRATEGIES = ("op_strategy_funcs", "op_single_dim_strategy_funcs",
               "op_to_schema_info_for_single_dim_strategy")  # fmt: skip


@contextlib.contextmanager
def as_in_torch_210(op, rules_too=False):
    """DTensor's sharding propagator without the strategies for ``op`` that torch 2.10 lacks
    (``rules_too``: without any rule for it either, as for the bicubic resampling)."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    names = _STRATEGIES + (("op_to_rules",) if rules_too else ())
    tables = [getattr(propagator, n) for n in names if isinstance(getattr(propagator, n, None),
                                                                   dict)]  # fmt: skip
    saved = [(t, t.pop(op)) for t in tables if op in t]
    forget = getattr(propagator.propagate_op_sharding, "cache_clear", lambda: None)
    forget()  # the decisions cached while the strategies were there
    try:
        yield
    finally:
        for table, rule in saved:
            table[op] = rule
        forget()


@pytest.fixture
def one_process_group(tmp_path):
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_the_plan_resamples_the_position_embedding_without_dtensors_rule(one_process_group):
    torch.manual_seed(0)
    args = dict(image_size=16, patch_size=4, depth=2, width=32, num_heads=4, mlp_dim=64,
                num_classes=10)  # fmt: skip
    plain = VisionTransformer(**args).eval()
    torch.nn.init.normal_(plain.head.weight)  # not zero as initialised: gradients flow back
    mesh = VisionTransformer(**args).eval()
    mesh.load_state_dict(plain.state_dict())
    parallelize_vit(mesh, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    x = torch.randn(2, 3, 24, 24)  # another size than the model's: the table is resampled
    with as_in_torch_210(BICUBIC, rules_too=True):
        # the rule is gone: an op on a replicated DTensor fails as it does on torch 2.10
        table = mesh.pos_embed.detach()
        with pytest.raises(NotImplementedError, match="_upsample_bicubic2d_aa"):
            torch.nn.functional.interpolate(table[None], size=(8, 8), mode="bicubic",
                                            antialias=True)  # fmt: skip
        with torch.no_grad():
            got = mesh(x)
    got = got.full_tensor() if isinstance(got, DTensor) else got
    with torch.no_grad():
        torch.testing.assert_close(got, plain(x), rtol=1e-5, atol=1e-5)
    # and differentiable: the table's gradient through the plan's resampling is the plain one's
    with as_in_torch_210(BICUBIC, rules_too=True):
        out = mesh(x)
        (out.full_tensor() if isinstance(out, DTensor) else out).square().sum().backward()
    plain(x).square().sum().backward()
    assert plain.pos_embed.grad.abs().sum() > 0
    torch.testing.assert_close(mesh.pos_embed.grad.full_tensor(), plain.pos_embed.grad,
                               rtol=1e-4, atol=1e-6)  # fmt: skip


def test_the_stems_gradients_are_replicated_whatever_dtensors_convolution_rule(one_process_group):
    torch.manual_seed(0)
    args = dict(image_size=16, patch_size=4, depth=1, width=32, num_heads=4, mlp_dim=64,
                num_classes=10)  # fmt: skip
    plain = VisionTransformer(**args)
    torch.nn.init.normal_(plain.head.weight)
    mesh = VisionTransformer(**args)
    mesh.load_state_dict(plain.state_dict())
    parallelize_vit(mesh, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    x = torch.randn(2, 3, 16, 16)
    with as_in_torch_210(CONV_BACKWARD):
        out = mesh(x)
        (out.full_tensor() if isinstance(out, DTensor) else out).square().sum().backward()
    plain(x).square().sum().backward()
    for name in ("weight", "bias"):
        grad = getattr(mesh.patch_embed.proj, name).grad
        # partial would be summed over the tensor-parallel processes: tp times the gradient
        assert grad.placements == (Replicate(),), (name, grad.placements)
        torch.testing.assert_close(grad.full_tensor(), getattr(plain.patch_embed.proj, name).grad,
                                   rtol=1e-4, atol=1e-6)  # fmt: skip
