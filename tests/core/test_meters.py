"""Device-side meters: top-k error against a reference, windows and epoch totals."""

import pytest
import torch

from pycls.core import meters


def test_topk_correct_matches_a_sorted_reference():
    torch.manual_seed(0)
    logits, labels = torch.randn(50, 7), torch.randint(0, 7, (50,))
    ranks = (logits > logits.gather(1, labels[:, None])).sum(dim=1)  # 0 = predicted first
    ref = [(ranks < k).sum().item() for k in (1, 5)]
    assert meters.topk_correct(logits, labels).tolist() == ref
    # fewer classes than k: top-5 of 3 classes is always right
    assert meters.topk_correct(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))[1] == 4


def test_windows_add_up_to_the_epoch():
    m = meters.Meter(torch.device("cpu"))
    batches = [
        (torch.tensor(1.0), torch.eye(3)[[0, 1]], torch.tensor([0, 2])),
        (torch.tensor(3.0), torch.eye(3)[[2, 2]], torch.tensor([2, 2])),
    ]
    m.update(*batches[0], num_skipped=1)
    first = m.sync()
    assert first["num_samples"] == 2 and first["top1_err"] == 50.0 and first["num_skipped"] == 1
    m.update(*batches[1])
    m.add_skipped(2)
    second = m.sync()
    assert second["loss"] == 3.0 and second["top1_err"] == 0.0 and second["num_skipped"] == 2
    total = m.epoch_stats()
    assert total["loss"] == pytest.approx((1.0 * 2 + 3.0 * 2) / 4)
    assert total["top1_err"] == 25.0 and total["num_samples"] == 4 and total["num_skipped"] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_meter_update_does_not_synchronise():
    m = meters.Meter(torch.device("cuda"))
    logits = torch.randn(8, 10, device="cuda")
    labels = torch.randint(0, 10, (8,), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        m.update(logits.sum(), logits, labels, num_skipped=0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert m.sync()["num_samples"] == 8


def test_eta_format():
    assert meters.eta_str(90061) == "1,01:01:01"


def test_iter_time_is_per_optimizer_step_not_per_micro_batch(monkeypatch):
    """Under TRAIN.ACCUM_STEPS the trainer's ETA multiplies iter_time by optimizer steps: it must
    be the time of one step (2 micro-batches here), not of one micro-batch."""
    clock = iter([0.0, 0.0, 10.0])  # reset(): last sync, epoch start; sync()
    monkeypatch.setattr(meters.time, "perf_counter", lambda: next(clock))
    m = meters.Meter(torch.device("cpu"))
    for _ in range(5):  # 5 optimizer steps of 2 micro-batches in 10 s
        for _ in range(2):
            m.update(torch.tensor(1.0), torch.eye(3)[[0]], torch.tensor([0]))
        m.end_step()
    m.sync()
    assert m.iter_time == pytest.approx(2.0)
