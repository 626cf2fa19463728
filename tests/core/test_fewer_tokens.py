"""Training on fewer tokens through the trainer: every combination the config accepts trains (AMP
levels, accumulation, EMA, mixup, clipping, skip-corrupt, DDP and FSDP2 on 2 gloo processes
without desynchronising, regional compilation without a recompile per batch), a stopped run
resumes exactly (the token sampler's place included), what cannot work is refused at load naming
both keys, and --mode info / --mode time count the effective tokens and time the step training
runs."""

import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pycls import config
from pycls import distributed as dist
from pycls.checkpoint import single_file as checkpoint
from pycls.checkpoint.resume import ChangedEpochError
from pycls.config import ConfigError
from pycls.core import benchmark, token_costs, trainer
from pycls.core.schedules import FixedImageSize, ImageSizeCurriculum, PatchDropSchedule
from pycls.core.training_step import TrainingStep
from pycls.models.vit import VisionTransformer
from pycls.models.vit.token_masks import TokenBatch
from tests.helpers import QUICKSTART, TINY, json_stats_of, load_tool, tiny_quickstart
from tests.helpers.distributed import spawn

try:  # torch.compile's counters, to see what compiling a block cost
    from torch._dynamo.utils import counters as dynamo_counters
except ImportError:
    dynamo_counters = None

# The quickstart's 16 px digits (4 px patches): steps capped at 2x2, 3x3 or 4x4 patches, images of
# a quarter to all of the cap's area, aspect ratios up to 2
TOKENS = ["TRAIN.TOKEN_BUDGET", "512", "TRAIN.TOKEN_SIZES", "[8, 12, 16]",
          "TRAIN.TOKEN_MAX_ASPECT", "2.0", "TRAIN.TOKEN_MIN_SCALE", "0.25"]  # fmt: skip
PACKED = [*TOKENS, "TRAIN.TOKEN_PACKING", "True"]
SHORT = ["OPTIM.MAX_EPOCH", "1", "TRAIN.EVAL_PERIOD", "1", "DEVICE", "cpu"]
CONV_STEM = ["VIT.STEM_TYPE", "conv", "VIT.C_STEM_CHANNELS", "[8, 8]", "VIT.C_STEM_KERNELS",
             "[3, 3]", "VIT.C_STEM_STRIDES", "[2, 2]"]  # fmt: skip
CURRICULUM = ["CURRICULUM.ENABLED", "True", "CURRICULUM.START_SIZE", "8", "CURRICULUM.STEP", "4"]


def _load(*overrides):
    return config.load_cfg(QUICKSTART, [*TINY, *overrides], for_this_machine=False)


# ------------------------------------------------------------------------------------------------ #
# What the config refuses, naming both keys
# ------------------------------------------------------------------------------------------------ #

REFUSED = [
    (["VIT.PATCH_DROP", "0.5", "VIT.FFN", "local"], "VIT.PATCH_DROP", "VIT.FFN"),
    ([*TOKENS, "VIT.FFN", "local"], "TRAIN.TOKEN_BUDGET", "VIT.FFN"),
    ([*TOKENS, *CONV_STEM], "TRAIN.TOKEN_BUDGET", "VIT.STEM_TYPE"),
    ([*TOKENS, "VIT.PATCH_DROP", "0.5"], "VIT.PATCH_DROP", "TRAIN.TOKEN_BUDGET"),
    ([*TOKENS, *CURRICULUM], "CURRICULUM.ENABLED", "TRAIN.TOKEN_BUDGET"),
    ([*TOKENS, "TRAIN.COMPILE", "True", "TRAIN.COMPILE_SCOPE", "model"], "TRAIN.COMPILE_SCOPE",
     "TRAIN.TOKEN_BUDGET"),
    ([*TOKENS, "DATA_LOADER.AUGMENT_DEVICE", "gpu"], "DATA_LOADER.AUGMENT_DEVICE",
     "TRAIN.TOKEN_BUDGET"),
    ([*TOKENS, "TRAIN.PARALLEL", "pipeline"], "TRAIN.TOKEN_BUDGET", "TRAIN.PARALLEL pipeline"),
    (["VIT.PATCH_DROP", "0.5", "TRAIN.PARALLEL", "pipeline"], "VIT.PATCH_DROP",
     "TRAIN.PARALLEL pipeline"),
    ([*TOKENS, "TRAIN.PARALLEL", "fsdp", "FSDP.BACKEND", "fairscale"], "TRAIN.TOKEN_BUDGET",
     "FSDP.BACKEND fairscale"),
    (["VIT.PATCH_DROP", "0.5", "TRAIN.PARALLEL", "tensor"], "VIT.PATCH_DROP",
     "TRAIN.PARALLEL tensor"),
    ([*TOKENS, "TRAIN.PARALLEL", "tensor"], "TRAIN.TOKEN_BUDGET", "TRAIN.PARALLEL tensor"),
    (["VIT.DROP_PATH", "0.1", "VIT.DROP_PATH_MODE", "skip", "TRAIN.PARALLEL", "tensor"],
     "VIT.DROP_PATH_MODE", "TRAIN.PARALLEL tensor"),
    # parquet's order by default (auto): shard by shard, where the budget plans a permutation
    ([*TOKENS, "DATA_LOADER.BACKEND", "parquet", "DATA.PATH", "/data/imagenet"],
     "DATA_LOADER.ORDER", "TRAIN.TOKEN_BUDGET"),
    ([*TOKENS, "VIT.DIST_TOKEN", "True"], "VIT.DIST_TOKEN", "TRAIN.TOKEN_BUDGET"),
    ([*TOKENS, "AMP.FLOAT8", "tensorwise"], "AMP.FLOAT8", "TRAIN.TOKEN_BUDGET"),
    (["VIT.DROP_PATH", "0.1", "VIT.DROP_PATH_MODE", "skip", "AMP.FLOAT8", "rowwise"],
     "AMP.FLOAT8", "VIT.DROP_PATH_MODE skip"),
    ([*TOKENS, "DISTILL.TYPE", "hard", "DISTILL.TEACHER", "zoo:RegNetY-200MF"], "DISTILL.TYPE",
     "TRAIN.TOKEN_BUDGET"),
    (["VIT.PATCH_DROP", "0.5", "VIT.PATCH_DROP_SCHEDULE", "curriculum"],
     "VIT.PATCH_DROP_SCHEDULE", "CURRICULUM.ENABLED"),
    (["VIT.PACKED_ATTENTION", "flex", "DEVICE", "cpu"], "VIT.PACKED_ATTENTION", "DEVICE cpu"),
    (["VIT.PACKED_ATTENTION", "flex", "DEVICE", "cuda", "VIT.DROP_PATH", "0.1",
      "VIT.DROP_PATH_MODE", "skip"], "VIT.PACKED_ATTENTION", "VIT.DROP_PATH_MODE"),
    (["VIT.PACKED_ATTENTION", "flex", "DEVICE", "cuda", "VIT.ATTN_DROPOUT", "0.1"],
     "VIT.PACKED_ATTENTION", "VIT.ATTN_DROPOUT"),
    ([*TOKENS, "TRAIN.TOKEN_BUDGET", "15"], "TRAIN.TOKEN_BUDGET", "16 patches"),
    ([*TOKENS, "TRAIN.TOKEN_SIZES", "[10]"], "TRAIN.TOKEN_SIZES", "VIT.PATCH_SIZE"),
    (["TRAIN.TOKEN_PACKING", "True"], "TRAIN.TOKEN_PACKING", "TRAIN.TOKEN_BUDGET"),
    (["TRAIN.TOKEN_MIN_SCALE", "0.5"], "TRAIN.TOKEN_MIN_SCALE", "TRAIN.TOKEN_BUDGET"),
    ([*TOKENS, "TRAIN.TOKEN_MAX_ASPECT", "0.5"], "TRAIN.TOKEN_MAX_ASPECT", ">= 1"),
    (["VIT.PATCH_DROP", "1.0"], "VIT.PATCH_DROP", "< 1"),
    (["VIT.DROP_PATH_MODE", "never"], "VIT.DROP_PATH_MODE", "skip"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,key,other", REFUSED, ids=[r[1] + " x " + r[2] for r in REFUSED])
def test_what_cannot_work_is_refused_at_load_naming_both_keys(overrides, key, other):
    with pytest.raises(ConfigError) as e:
        _load(*overrides)
    message = str(e.value)
    assert message.startswith(f"{key}:") and other in message, message


def test_token_keys_are_refused_for_the_cnns():
    regnet = os.path.join(os.path.dirname(QUICKSTART), "quickstart_regnet.yaml")
    for overrides, key in ((TOKENS, "TRAIN.TOKEN_BUDGET"), (["VIT.PATCH_DROP", "0.5"],
                                                            "VIT.PATCH_DROP")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"^{key}: .*MODEL.TYPE vit"):
            config.load_cfg(regnet, overrides, for_this_machine=False)


def test_flex_attention_on_a_machine_without_cuda_is_refused_before_any_work():
    cfg = _load("VIT.PACKED_ATTENTION", "flex")  # DEVICE auto: nothing to say at load
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    # the run's one step for this machine (DEVICE auto -> cpu), before any process starts
    with pytest.raises(ConfigError, match="^VIT.PACKED_ATTENTION: flex cannot be used with DEVICE"):
        config.resolve_for_machine(cfg)


# ------------------------------------------------------------------------------------------------ #
# The patch-dropout schedule
# ------------------------------------------------------------------------------------------------ #


def test_patch_drop_schedule_constant_curriculum_and_unmasked_end():
    constant = PatchDropSchedule(0.5, off_epoch=8)
    assert [constant(e) for e in (0, 7, 8, 20)] == [0.5, 0.5, 0.0, 0.0]
    sizes = ImageSizeCurriculum(start=64, step=32, epochs_per_step=2, final=128, base_batch=32)
    tied = PatchDropSchedule(0.75, schedule="curriculum", sizes=sizes, patch_size=16)
    # 128 px: 64 patches, a quarter kept = 16 per image; 96 px: 36 patches, 16 kept; 64 px: 16
    assert tied(4) == 0.75
    assert tied(2) == pytest.approx(1 - 16 / 36)
    assert tied(0) == 0.0
    scaled = ImageSizeCurriculum(start=64, step=32, epochs_per_step=2, final=128, base_batch=32,
                                 scale_batch=True)  # fmt: skip
    # the batch grows as the image shrinks: the tokens per batch are already the final ones
    assert PatchDropSchedule(0.75, schedule="curriculum", sizes=scaled, patch_size=16)(0) == 0.75
    assert PatchDropSchedule(0.0)(3) == 0.0
    with pytest.raises(ValueError, match="image-size schedule"):
        PatchDropSchedule(0.5, schedule="curriculum")
    assert FixedImageSize(16, 32).batch_size(3) == 32


def test_trainer_sets_each_epochs_rate(tmp_path):
    cfg = tiny_quickstart(tmp_path, *SHORT, *CURRICULUM, "VIT.PATCH_DROP", "0.75",
                          "VIT.PATCH_DROP_SCHEDULE", "curriculum", "VIT.PATCH_DROP_OFF_EPOCH", "3",
                          "CURRICULUM.EPOCHS_PER_STEP", "1", "OPTIM.MAX_EPOCH", "4")  # fmt: skip
    t = trainer.Trainer(cfg, torch.device("cpu"))
    rates = []
    for epoch in range(4):
        t._apply_image_size(epoch)
        rates.append(t.engine.module.patch_drop)
    # 8 px: 4 patches <= the 4 kept at 16 px; 12 px: 9 patches, 4 kept; 16 px: 0.75; unmasked
    assert rates == [0.0, pytest.approx(5 / 9), 0.75, 0.0]


# ------------------------------------------------------------------------------------------------ #
# Training runs
# ------------------------------------------------------------------------------------------------ #

COMBINATIONS = {
    "patch_drop_o1_accum_ema_mixup": ["VIT.PATCH_DROP", "0.5", "AMP.LEVEL", "O1",
                                      "TRAIN.ACCUM_STEPS", "2", "TRAIN.EMA", "True",
                                      "MIXUP.ALPHA", "0.8", "OPTIM.CLIP_GRAD", "1.0"],
    "patch_drop_curriculum_o2": [*CURRICULUM, "CURRICULUM.SCALE_BATCH", "True", "VIT.PATCH_DROP",
                                 "0.75", "VIT.PATCH_DROP_SCHEDULE", "curriculum", "AMP.LEVEL",
                                 "O2", "VIT.CLASSIFIER", "token"],
    "skip_o3_layer_decay": ["VIT.DROP_PATH", "0.5", "VIT.DROP_PATH_MODE", "skip", "AMP.LEVEL",
                            "O3", "OPTIM.LAYER_DECAY", "0.8", "VIT.DEPTH", "2"],
    "padded_o1_cutmix_ema_checkpointing": [*TOKENS, "AMP.LEVEL", "O1", "MIXUP.CUTMIX_ALPHA",
                                           "1.0", "TRAIN.EMA", "True", "VIT.CLASSIFIER", "token",
                                           "VIT.CHECKPOINT_BLOCKS", "1"],
    "packed_accum_skip_mixup_repeats": [*PACKED, "TRAIN.ACCUM_STEPS", "2", "VIT.DROP_PATH", "0.3",
                                        "VIT.DEPTH", "2",
                                        "VIT.DROP_PATH_MODE", "skip", "MIXUP.ALPHA", "0.8",
                                        "MIXUP.CUTMIX_ALPHA", "1.0", "TRAIN.REPEATED_AUG", "2",
                                        "VIT.NUM_REGISTERS", "1", "DATA_LOADER.SKIP_CORRUPT",
                                        "True"],
    "packed_o2_workers": [*PACKED, "AMP.LEVEL", "O2", "DATA_LOADER.NUM_WORKERS", "1"],
}  # fmt: skip


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_each_accepted_combination_trains(tmp_path, name):
    trainer.train_model(tiny_quickstart(tmp_path, *SHORT, *COMBINATIONS[name]))
    (epoch,) = json_stats_of(tmp_path, "train_epoch")
    assert epoch["num_samples"] > 0 and epoch["loss"] == epoch["loss"]  # finite
    assert epoch["tokens_per_image"] > 0 and epoch["tokens_per_sec"] > 0
    (test,) = json_stats_of(tmp_path, "test_epoch")
    assert test["num_samples"] == 359  # evaluation: every image, every token
    (cx,) = json_stats_of(tmp_path, "complexity")
    assert cx["flops_effective"] < cx["flops"]


def test_token_budget_trains_as_many_patch_tokens_per_step_as_it_says(tmp_path):
    cfg = tiny_quickstart(tmp_path, *SHORT, *PACKED)
    t = trainer.Trainer(cfg, torch.device("cpu"))
    seen = []
    for batch, labels, _ in t.train_batches:
        assert isinstance(batch, TokenBatch) and batch.canvas.dtype == torch.float32
        s, length = batch.segments.shape
        seen.append((labels.numel(), s, length))
    assert len(seen) == len(t.train_loader)
    # pooled, no class token: budget // cap sequences of cap positions, whatever the cap
    assert {(s, length) for _, s, length in seen} == {(512 // c, c) for c in (4, 9, 16)}


def _stopped_mid_epoch(out, *args):
    class Stop:  # a preemption flag already raised: the run checkpoints at its first sync point
        requested, interrupted = True, False

    cfg = tiny_quickstart(out, *args)
    t = trainer.Trainer(cfg, trainer.setup_env(cfg))  # seeded as train_model seeds it
    t.resume_or_init()
    t.preemption = Stop()
    with pytest.raises(dist.Preempted):
        t.train_epoch(0)
    return checkpoint.get_last_checkpoint(str(out))


def _final_weights(out):
    return checkpoint.load_file(checkpoint.get_checkpoint_path(str(out), 2))["model_state"]


@pytest.mark.parametrize("name", ["packed", "patch_drop"])
def test_a_stopped_run_resumes_exactly(tmp_path, name):
    """Stopped mid-epoch (the token sampler's place in the plan, the RNG, the EMA), the resumed
    run ends with the weights of the run never stopped."""
    extra = {
        "packed": [*PACKED, "VIT.DROP_PATH", "0.3", "VIT.DROP_PATH_MODE", "skip", "MIXUP.ALPHA",
                   "0.8", "TRAIN.EMA", "True", "VIT.DEPTH", "2"],
        "patch_drop": ["VIT.PATCH_DROP", "0.5", "MIXUP.CUTMIX_ALPHA", "1.0"],
    }[name]  # fmt: skip
    args = ["DEVICE", "cpu", "OPTIM.MAX_EPOCH", "2", "LOG_PERIOD", "3", "TRAIN.EVAL_PERIOD", "2",
            *extra]  # fmt: skip
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    trainer.train_model(tiny_quickstart(straight, *args))
    last = _stopped_mid_epoch(stopped, *args)
    assert "_iter_" in last
    trainer.train_model(tiny_quickstart(stopped, *args))
    a, b = _final_weights(straight), _final_weights(stopped)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resuming_a_token_epoch_under_another_plan_is_refused(tmp_path):
    args = ["DEVICE", "cpu", "OPTIM.MAX_EPOCH", "1", "LOG_PERIOD", "3", *PACKED]
    _stopped_mid_epoch(tmp_path, *args)
    other = tiny_quickstart(tmp_path, *args, "TRAIN.TOKEN_MIN_SCALE", "0.5")
    with pytest.raises(ChangedEpochError, match="^TRAIN.TOKEN_BUDGET: the token batches"):
        trainer.Trainer(other, torch.device("cpu")).resume_or_init()


# ------------------------------------------------------------------------------------------------ #
# --mode info and --mode time
# ------------------------------------------------------------------------------------------------ #


def test_info_reports_flops_at_the_effective_tokens(tmp_path):
    full = benchmark.print_info(tiny_quickstart(tmp_path))
    dropped = benchmark.print_info(tiny_quickstart(tmp_path, "VIT.PATCH_DROP", "0.75"))
    assert dropped["flops"] == full["flops"] and "flops_effective" not in full
    assert dropped["tokens_per_image"] == 4 and dropped["flops_effective"] < full["flops"] / 2
    packed = benchmark.print_info(tiny_quickstart(tmp_path, *PACKED))
    padded = benchmark.print_info(tiny_quickstart(tmp_path, *TOKENS))
    assert packed["tokens_per_image"] < padded["tokens_per_image"] <= 16


def test_patch_dropout_with_the_distillation_token_is_counted_as_it_runs():
    """The distillation token is a prefix token: patch dropout keeps it, and the FLOPs at the
    kept tokens count it (and its head) as FlopCounterMode sees the work."""
    torch.manual_seed(0)
    model = VisionTransformer(image_size=16, patch_size=4, depth=2, width=32, num_heads=2,
                              mlp_dim=64, num_classes=10, classifier="token", dist_token=True,
                              patch_drop=0.5).train()  # fmt: skip
    images = torch.randn(8, 3, 16, 16)
    assert model.num_prefix_tokens == 2
    assert model.forward_features(images).shape[1] == 2 + 8  # class and distillation tokens kept
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(images)
    per_image = token_costs.flops_per_image(model, images, 16, training=True)
    assert counter.get_total_flops() == pytest.approx(2 * 8 * per_image, rel=1e-12)


def test_skipped_branches_are_not_counted():
    """Compute-skipping stochastic depth: each block counted for the samples it keeps (rates 0,
    0.25, 0.5 over 3 blocks: 8, 6 and 4 of 8), as FlopCounterMode sees the work."""
    torch.manual_seed(0)
    model = VisionTransformer(image_size=16, patch_size=4, depth=3, width=32, num_heads=2,
                              mlp_dim=64, num_classes=10, drop_path=0.5,
                              drop_path_mode="skip").train()  # fmt: skip
    images = torch.randn(8, 3, 16, 16)
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(images)
    per_image = token_costs.flops_per_image(model, images, 16, training=True)
    assert counter.get_total_flops() == pytest.approx(2 * 8 * per_image, rel=1e-12)
    assert token_costs.block_fractions(model, 8) == [1.0, 0.75, 0.5]
    assert per_image < model.complexity()["flops"]
    assert (
        token_costs.flops_per_image(model, images, 16, training=False)
        == model.complexity()["flops"]
    )


@pytest.mark.parametrize("table,contender", [("packing", "packed"), ("drop_path", "skip 0.5")])
def test_the_benchmark_times_the_trainers_step_per_image(tmp_path, table, contender):
    tool = load_tool("fewer_tokens", "fewer_tokens_benchmark", folder="benchmarks")
    job = dict(table=table, arch="tiny", amp="O0", overrides=tool.SPEED_TABLES[table][contender],
               tiny=True, batch_size=4, threads=1, warmup=0, iters=1, device="cpu",
               compile=False, out_dir=str(tmp_path))  # fmt: skip
    result = tool.run_worker(job)
    assert len(result["times"]) == 1 and result["times"][0] > 0
    assert result["packed"] == (contender == "packed") and result["images"] >= 4
    assert result["gflops_per_image"] > 0 and result["tokens_per_image"] <= 16


def test_the_accuracy_table_runs_every_seed_and_averages_them(monkeypatch):
    """Each variant runs once per seed with its own overrides; the row is the
    seeds' mean error and CPU time, each seed's error beside it; equal-time runs follow from the
    mean times."""
    tool = load_tool("fewer_tokens", "fewer_tokens_benchmark", folder="benchmarks")
    started = []

    def fake_train(runs, tiny, jobs):
        out = {}
        for (name, seed), (overrides, epochs) in runs.items():
            started.append((name, seed, epochs))
            assert overrides == tool.ACCURACY[name.removesuffix(", equal time")]
            keep = 0.5 if "keep 0.5" in name else 1.0
            err = {1: 2.0, 2: 10.0}[seed] + (0 if keep == 1.0 else 1.0)
            out[(name, seed)] = {"times": [100.0 * keep * epochs / 40 + seed], "top1_err": err,
                                 "epochs": epochs, "tokens_per_image": 16 * keep}  # fmt: skip
        return out

    monkeypatch.setattr(tool, "train_quickstarts", fake_train)
    args = tool.parse_args(["--tables", "accuracy", "--variants", "keep 0.5", "--seeds", "1", "2"])
    _, lines, dump = tool.accuracy_table(args)
    assert {(n, s) for n, s, _ in started} == {
        (n, s) for n in ("all tokens", "keep 0.5", "keep 0.5, equal time") for s in (1, 2)
    }
    # equal time: the mean CPU times 101.5 s and 51.5 s -> 40 x 1.97 = 79 epochs
    assert {e for n, _, e in started if n.endswith("equal time")} == {79}
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines if "| " in line}
    assert rows["all tokens"][3:5] == ["6.00", "2.0 / 10.0"]
    assert rows["keep 0.5"][3:6] == ["7.00", "3.0 / 11.0", "+1.00"]
    assert set(dump) == {f"{n}/seed {s}" for n, s, _ in started}


@pytest.mark.parametrize("name", ["patch_drop", "packed"])
def test_time_mode_runs_the_masked_or_packed_step_training_runs(tmp_path, monkeypatch, name):
    extra = {"patch_drop": ["VIT.PATCH_DROP", "0.75"], "packed": PACKED}[name]
    cfg = tiny_quickstart(tmp_path, "DEVICE", "cpu", "PREC_TIME.WARMUP_ITER", "1",
                          "PREC_TIME.NUM_ITER", "2", *extra)  # fmt: skip
    steps = []
    call = TrainingStep.__call__

    def counted(self, batches, *args, **kwargs):
        images, labels, skipped = next(batches)
        steps.append((images, self.count_tokens(images)))
        return call(self, iter([(images, labels, skipped)]), *args, **kwargs)

    monkeypatch.setattr(TrainingStep, "__call__", counted)
    stats = benchmark.time_model(cfg)
    # the trainer's own step: warm-up and timed (3), then NUM_ITER steps back to back (2)
    assert len(steps) == 3 + 2
    images, tokens = steps[0]
    if name == "packed":
        assert isinstance(images, TokenBatch) and tokens == images.counts[1]
        assert stats["batch_size"] == images.num_images
    else:
        assert tokens == images.shape[0] * 4  # a quarter of 16 patches, pooled: no class token
        assert stats["gflops_per_image"] < stats["test_gflops_per_image"] / 2


# ------------------------------------------------------------------------------------------------ #
# Two gloo processes: DDP, FSDP2 and the pipeline
# ------------------------------------------------------------------------------------------------ #

SKIP = ["VIT.DEPTH", "2", "VIT.DROP_PATH", "0.3", "VIT.DROP_PATH_MODE", "skip"]
DISTRIBUTED = {
    "ddp_packed_skip_mixup_o1": ["TRAIN.PARALLEL", "ddp", *PACKED, *SKIP, "MIXUP.ALPHA", "0.8",
                                 "AMP.LEVEL", "O1"],
    "fsdp_packed_skip_ema": ["TRAIN.PARALLEL", "fsdp", *PACKED, *SKIP, "TRAIN.EMA", "True"],
    "fsdp_padded_o2": ["TRAIN.PARALLEL", "fsdp", *TOKENS, "AMP.LEVEL", "O2"],
    "ddp_patch_drop_accum": ["TRAIN.PARALLEL", "ddp", "VIT.PATCH_DROP", "0.5",
                             "TRAIN.ACCUM_STEPS", "2"],
    "fsdp_patch_drop_skip": ["TRAIN.PARALLEL", "fsdp", "VIT.PATCH_DROP", "0.5", *SKIP],
    "pipeline_skip": ["TRAIN.PARALLEL", "pipeline", *SKIP],
}  # fmt: skip


def _init_process(rank, world, port):
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size=world + 1, is_master=False)
    env = dist.ProcessEnv(rank, world, rank, "127.0.0.1", port, "spawn")
    dist.init_process_group(env, "cpu", store=store)


def _distributed_worker(rank, world, port, out_dir):
    """One epoch of each configuration in this process; what every process saw, gathered."""
    _init_process(rank, world, port)
    try:
        results = {}
        for name, overrides in DISTRIBUTED.items():
            cfg = tiny_quickstart(os.path.join(out_dir, name), *SHORT, *overrides)
            t = trainer.Trainer(cfg, trainer.setup_env(cfg))
            stats = t.train_epoch(0)
            module = t.engine.module
            local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
            checksum = float(sum(p.detach().double().sum() for p in local))
            mine = {"steps": len(t.train_loader) // cfg.TRAIN.ACCUM_STEPS, "checksum": checksum,
                    "num_samples": stats["num_samples"], "loss": stats["loss"],
                    "tokens_per_image": stats.get("tokens_per_image")}  # fmt: skip
            gathered = [None] * world
            torch.distributed.all_gather_object(gathered, mine)
            weights = t.engine.full_state_dict()
            finite = all(bool(torch.isfinite(w).all()) for w in weights.values())
            results[name] = {"ranks": gathered, "finite": finite}
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "results.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("two_processes"))
    spawn(_distributed_worker, 2, out)
    return torch.load(os.path.join(out, "results.pt"), weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_two_processes_train_in_step_without_desynchronising(two_processes, name):
    """Each process plans the same steps (padding and packing differ per process, the step count
    does not), both finish the epoch, the weights are finite; DDP's replicas stay identical."""
    result = two_processes[name]
    first, second = result["ranks"]
    assert first["steps"] == second["steps"] > 0
    assert first["num_samples"] == second["num_samples"] > 0  # the epoch's images, all processes
    assert result["finite"] and first["loss"] == first["loss"]
    if name.startswith("ddp"):
        assert first["checksum"] == second["checksum"]
    if "tokens" in name or "packed" in name or "padded" in name or "patch" in name:
        assert first["tokens_per_image"] < 16


# ------------------------------------------------------------------------------------------------ #
# Regional compilation
# ------------------------------------------------------------------------------------------------ #


@pytest.fixture
def graphs_without_codegen(monkeypatch):
    """TRAIN.COMPILE with the aot_eager backend: the graphs (and their count, dynamo's) are those
    inductor would get, without its code generation (about 15 CPU s per test from an empty
    cache). Both tests pass alike under inductor (2026-11-27)."""
    from pycls.engines import base

    def compile_model(*args, **kwargs):
        return base_compile(*args, **{**kwargs, "backend": "aot_eager"})

    base_compile = base.compile_model
    monkeypatch.setattr(base, "compile_model", compile_model)
    monkeypatch.setattr(trainer, "compile_model", compile_model)


@pytest.mark.slow  # compiling on the CPU
@pytest.mark.skipif(dynamo_counters is None, reason="torch without torch._dynamo")
def test_compiled_blocks_are_not_compiled_again_per_batch(tmp_path, graphs_without_codegen):
    """The caps give a few sequence shapes, not one per batch: an epoch of packed batches of
    every grid compiles the blocks' graph at most once per cap (the canvas, whose size changes
    with every batch, goes through the stem, which is not compiled)."""
    cfg = tiny_quickstart(tmp_path, *SHORT, *PACKED, "TRAIN.COMPILE", "True", "VIT.DEPTH", "2")
    t = trainer.Trainer(cfg, trainer.setup_env(cfg))
    t.resume_or_init()
    torch._dynamo.reset()
    dynamo_counters.clear()
    t.train_epoch(0)
    steps = len(t.train_loader)
    graphs = dynamo_counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 3 < steps, (graphs, steps)


@pytest.mark.slow  # compiling on the CPU
@pytest.mark.skipif(dynamo_counters is None, reason="torch without torch._dynamo")
def test_compiled_blocks_train_with_patch_dropout_and_skipping(tmp_path, graphs_without_codegen):
    """Patch dropout keeps one token count per epoch and skipping one kept count per batch size:
    a training epoch compiles the blocks' graph once per block configuration, not per batch.
    Each block's drop-path rate is a constant of its graph (they rise linearly from 0, so the
    first block runs without skipping): two blocks, two graphs, however many batches."""
    cfg = tiny_quickstart(tmp_path, *SHORT, "TRAIN.COMPILE", "True", "VIT.PATCH_DROP", "0.5",
                          *SKIP)  # fmt: skip
    t = trainer.Trainer(cfg, trainer.setup_env(cfg))
    t.resume_or_init()
    torch._dynamo.reset()
    dynamo_counters.clear()
    stats = t.train_epoch(0)
    assert stats["tokens_per_image"] == 8 and stats["loss"] == stats["loss"]
    rates = {block.drop_path.p for block in t.engine.module.repeated_blocks()}
    assert len(rates) == 2
    assert dynamo_counters["stats"]["unique_graphs"] == len(rates) < len(t.train_loader)
