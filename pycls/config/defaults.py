"""The key tree: every option pycls understands, its default and what it means.

Each key is documented where it is defined, here. ``pycls.config.validation`` says which values and
combinations are valid; ``pycls.config.loading`` merges files and overrides into a copy of these
defaults.
"""

from yacs.config import CfgNode

# The defaults; every config is a copy (get_default_cfg, load_cfg), passed around as an argument
_C = CfgNode()


# ------------------------------------------------------------------------------------------------ #
# Model
# ------------------------------------------------------------------------------------------------ #
_C.MODEL = CfgNode()

# Model family: "vit", or upstream pycls's convolutional families "anynet", "regnet", "resnet",
# "effnet" (their keys are in the section "Convolutional model families" below)
_C.MODEL.TYPE = "vit"

# A named variant from pycls.models.vit.variants (vit_ti16 ... vit_h14) whose sizes replace the
# defaults of VIT.PATCH_SIZE, VIT.DEPTH, VIT.WIDTH, VIT.NUM_HEADS and VIT.MLP_DIM. A VIT key written
# explicitly (in the YAML file or as KEY VALUE) wins over the preset: "--cfg vit_ti16.yaml
# VIT.DEPTH 6" is a 6-block ViT-Ti. "" means no preset: the VIT keys as written, else their
# defaults below (ViT-B/16 sizes)
_C.MODEL.ARCH = ""

# Number of output classes
_C.MODEL.NUM_CLASSES = 1000

# Loss function: "cross_entropy" (with TRAIN.LABEL_SMOOTHING)
_C.MODEL.LOSS_FUN = "cross_entropy"

# Model scaling ("Fast and Accurate Model Scaling"), read by --mode scale only: the type names the
# dimensions and their weights ("d1_w8_g8_r1" is fast compound scaling; "dw" = "d1_w1"), the factor
# the multiple of FLOPs wanted (pycls.core.scale_config)
_C.MODEL.SCALING_TYPE = ""
_C.MODEL.SCALING_FACTOR = 1.0


# ------------------------------------------------------------------------------------------------ #
# Vision Transformer
# ------------------------------------------------------------------------------------------------ #
_C.VIT = CfgNode()

# Patch size in pixels (the stem's total stride); image sizes must be multiples of it
_C.VIT.PATCH_SIZE = 16

# Number of transformer blocks
_C.VIT.DEPTH = 12

# Token width (hidden dimension)
_C.VIT.WIDTH = 768

# Number of attention heads; WIDTH must be divisible by it
_C.VIT.NUM_HEADS = 12

# Hidden dimension of the feed-forward block (4 x WIDTH in the standard variants)
_C.VIT.MLP_DIM = 3072

# Stem: "patchify" (one strided conv) or "conv" (stacked 3x3 convs, "Early convolutions help
# transformers see better")
_C.VIT.STEM_TYPE = "patchify"

# Conv stem only: output channels, kernel sizes and strides of the 3x3 convs (the product of the
# strides must equal PATCH_SIZE); a final 1x1 conv maps to WIDTH
_C.VIT.C_STEM_CHANNELS = [64, 128, 128, 256]
_C.VIT.C_STEM_KERNELS = [3, 3, 3, 3]
_C.VIT.C_STEM_STRIDES = [2, 2, 2, 2]

# Classifier: "token" (class token) or "pooled" (average of the patch tokens, no class token).
# The default is the original ViT's, the same as VisionTransformer's and the zoo functions'
# (vit_b16(...)); the ViT configs in configs/ that train from scratch choose "pooled" explicitly
_C.VIT.CLASSIFIER = "token"

# Token layout through the encoder: "batch_first" (N, L, D) or "batch_second" (L, N, D). The
# default is VisionTransformer's; every ViT config in configs/ chooses one explicitly
# ("batch_second" for the small images of the quickstart and CIFAR)
_C.VIT.LAYOUT = "batch_first"

# Feed-forward block: "mlp" (Linear-GELU-Linear) or "local" (Linear, h-swish, 3x3 depthwise conv
# over the token grid, h-swish, Linear)
_C.VIT.FFN = "mlp"

# Position embedding: "learned" or "sincos" (fixed 2-D sine-cosine)
_C.VIT.POS_EMBED = "learned"

# Dropout after the embedding and in the MLP, dropout on the attention weights
_C.VIT.DROPOUT = 0.0
_C.VIT.ATTN_DROPOUT = 0.0

# Stochastic depth: the drop-path rate grows linearly over the blocks up to this value
_C.VIT.DROP_PATH = 0.0

# How stochastic depth drops a sample's branch: "multiply" (computed for every sample, the dropped
# ones multiplied by zero, as timm) or "skip" (computed for the kept samples only: a random
# floor(n (1 - rate)) of a block's n samples, scaled by n / kept, as DINOv2; the same update in
# expectation, less work). In packed token batches (TRAIN.TOKEN_PACKING) a sample is a sequence
_C.VIT.DROP_PATH_MODE = "multiply"

# Patch dropout (PatchDropout, FLIP): while training, each image keeps a random 1 - PATCH_DROP of
# its patch tokens after the position embedding (at least one; the class and register tokens
# stay), so the blocks run on fewer tokens. Evaluation always sees every token. 0 = off
_C.VIT.PATCH_DROP = 0.0

# How the patch-dropout rate changes over training: "constant" (PATCH_DROP every epoch) or
# "curriculum" (with CURRICULUM.ENABLED: the rate at each epoch's image size that keeps the tokens
# of a batch where PATCH_DROP puts them at the final size, so small early images drop fewer or none)
_C.VIT.PATCH_DROP_SCHEDULE = "constant"

# Train on every token from this epoch on (0-based; 0 = never): FLIP's unmasked tuning at the end
_C.VIT.PATCH_DROP_OFF_EPOCH = 0

# How attention stays inside each image of a token batch (TRAIN.TOKEN_BUDGET): "sdpa" (a boolean
# mask), "flex" (a FlexAttention block mask: the masked blocks skipped, once compiled; needs a torch
# that has it) or "auto" (flex on CUDA with TRAIN.COMPILE, sdpa otherwise)
_C.VIT.PACKED_ATTENTION = "auto"

# LayerNorm epsilon
_C.VIT.NORM_EPS = 1e-6

# Activation checkpointing: recompute the first k blocks in the backward pass (saves memory)
_C.VIT.CHECKPOINT_BLOCKS = 0

# Keep a class token with the pooled classifier too (MAE/BEiT fine-tuning layout: the token takes
# part in attention, the head averages the patch tokens); the token classifier always has one
_C.VIT.CLASS_TOKEN = False

# Learned register tokens after the class token ("Vision Transformers need registers"); they are
# left out of the pooled average
_C.VIT.NUM_REGISTERS = 0

# Bias in the attention's qkv projection (False in some pretrained models)
_C.VIT.QKV_BIAS = True

# A LayerNorm on the embedded tokens before the first block, and no bias in the patchify
# projection (CLIP-style, timm's pre_norm)
_C.VIT.PRE_NORM = False

# Normalise after pooling instead of before it (timm's fc_norm, as in MAE/BEiT fine-tuning)
_C.VIT.FC_NORM = False

# Classifier head initialisation: 0 = zeros; s > 0 = truncated normal with std 0.02 * s (BEiT and
# MAE fine-tune with 0.001)
_C.VIT.HEAD_INIT_SCALE = 0.0

# DeiT's distillation token: a second token after the class token, read by a second head
# (head_dist) that DISTILL trains on the teacher's predictions; evaluation averages the two heads.
# The layout of timm's deit_*_distilled_patch16_224 (VisionTransformerDistilled)
_C.VIT.DIST_TOKEN = False


# ------------------------------------------------------------------------------------------------ #
# Convolutional model families (upstream pycls's keys, names and defaults; MODEL.TYPE anynet,
# regnet, resnet, effnet). pycls.core.builders maps them to the models' keyword arguments
# ------------------------------------------------------------------------------------------------ #

# Number of weight layers of MODEL.TYPE resnet: 50, 101 or 152 on ImageNet-style data; 6n + 2
# (20, 56, 110, ...) when TRAIN.DATASET is cifar10/cifar100 (the CIFAR layout)
_C.MODEL.DEPTH = 0

# Activation of the CNN families: "relu", "silu" (= "swish", EfficientNet's) or "gelu"
_C.MODEL.ACTIVATION_FUN = "relu"

# Apply ReLU in place (saves one activation tensor per layer)
_C.MODEL.ACTIVATION_INPLACE = True

# ---- ResNet / ResNeXt (MODEL.TYPE resnet) ----
_C.RESNET = CfgNode()

# Residual branch: "basic_transform" (two 3x3 convs; the CIFAR layout) or "bottleneck_transform"
# (1x1, 3x3, 1x1; the ImageNet layout)
_C.RESNET.TRANS_FUN = "basic_transform"

# Groups of the 3x3 conv (1 -> ResNet, > 1 -> ResNeXt)
_C.RESNET.NUM_GROUPS = 1

# Width of each group in the first stage (64 -> ResNet, 4 -> ResNeXt 32x4d); doubles per stage
_C.RESNET.WIDTH_PER_GROUP = 64

# Stride on the first 1x1 conv of a bottleneck (MSRA's original) instead of on the 3x3 conv
# (fb.torch, torchvision)
_C.RESNET.STRIDE_1X1 = True

# ---- AnyNet (MODEL.TYPE anynet): stem, stages of blocks, head ----
_C.ANYNET = CfgNode()

# Stem: "res_stem_cifar" (3x3 conv), "res_stem_in" (7x7/2 conv + 3x3/2 max-pool) or
# "simple_stem_in" (3x3/2 conv)
_C.ANYNET.STEM_TYPE = "simple_stem_in"

# Stem output width
_C.ANYNET.STEM_W = 32

# Block: "vanilla_block", "res_basic_block", "res_bottleneck_block" or
# "res_bottleneck_linear_block"
_C.ANYNET.BLOCK_TYPE = "res_bottleneck_block"

# Per stage: number of blocks, output width, stride of the first block
_C.ANYNET.DEPTHS = []
_C.ANYNET.WIDTHS = []
_C.ANYNET.STRIDES = []

# Per stage, bottleneck blocks only: bottleneck width / output width, and the group width of the
# 3x3 conv (the bottleneck width must be a multiple of it)
_C.ANYNET.BOT_MULS = []
_C.ANYNET.GROUP_WS = []

# Width of a 1x1 conv in the head before pooling (0 = no conv)
_C.ANYNET.HEAD_W = 0

# Squeeze-and-excitation in the bottleneck blocks, and its width relative to the block's input
_C.ANYNET.SE_ON = False
_C.ANYNET.SE_R = 0.25

# ---- RegNet (MODEL.TYPE regnet): an AnyNet whose widths follow a quantized linear rule ----
_C.REGNET = CfgNode()

# Stem and block types and stem width (as ANYNET.*)
_C.REGNET.STEM_TYPE = "simple_stem_in"
_C.REGNET.STEM_W = 32
_C.REGNET.BLOCK_TYPE = "res_bottleneck_block"

# Stride of every stage
_C.REGNET.STRIDE = 2

# Squeeze-and-excitation (RegNetY) and its ratio
_C.REGNET.SE_ON = False
_C.REGNET.SE_R = 0.25

# Total number of blocks
_C.REGNET.DEPTH = 10

# Initial width (a multiple of 8), slope, and width multiplier between stages: block i would be
# W0 + WA * i wide; widths are snapped to W0 * WM^k and blocks of one width form a stage
_C.REGNET.W0 = 32
_C.REGNET.WA = 5.0
_C.REGNET.WM = 2.5

# Group width of the 3x3 convs
_C.REGNET.GROUP_W = 16

# Bottleneck multiplier (1 / b in the paper)
_C.REGNET.BOT_MUL = 1.0

# Width of a 1x1 conv in the head (0 = none)
_C.REGNET.HEAD_W = 0

# ---- EfficientNet (MODEL.TYPE effnet) ----
_C.EN = CfgNode()

# Stem width
_C.EN.STEM_W = 32

# Per stage: blocks, output width, expansion ratio of the MBConv blocks, stride of the first
# block, depthwise kernel size
_C.EN.DEPTHS = []
_C.EN.WIDTHS = []
_C.EN.EXP_RATIOS = []
_C.EN.STRIDES = []
_C.EN.KERNELS = []

# Squeeze-and-excitation width relative to each block's input width
_C.EN.SE_R = 0.25

# Width of the head's 1x1 conv
_C.EN.HEAD_W = 1280

# Drop-connect (stochastic depth) rate of the blocks with a skip, while training
_C.EN.DC_RATIO = 0.0

# Dropout before the classifier
_C.EN.DROPOUT_RATIO = 0.0

# Folder of the model zoo's published weights, read by TRAIN.WEIGHTS / TEST.WEIGHTS
# "zoo:NAME" (e.g. zoo:RegNetY-800MF; the names of pycls.models.list_models()): the file is taken
# from here if present, else downloaded here. "" = the PYCLS_ZOO_DIR environment variable, else
# ~/.cache/pycls/zoo. Offline, the error names the URL and the path to put the file at
_C.MODEL.ZOO_DIR = ""

# Memory format of a CNN's weights and input batches: "auto" (channels_last for the CNN families
# on CUDA under TRAIN.PARALLEL none or ddp, where cuDNN's convolutions prefer it; contiguous
# otherwise), "channels_last" or "contiguous". The ViT is always contiguous
_C.MODEL.MEMORY_FORMAT = "auto"

# ---- Batch norm (the CNN families) ----
_C.BN = CfgNode()

# Epsilon and momentum (PyTorch's convention: the weight of the new batch's statistics)
_C.BN.EPS = 1e-5
_C.BN.MOM = 0.1

# Start the last BN of each residual branch at zero, so each block begins as the identity
_C.BN.ZERO_INIT_FINAL_GAMMA = False

# Precise statistics: before each evaluation, replace every BN's running mean and variance by
# their average over NUM_SAMPLES_PRECISE training images (all processes together, at most one
# pass) with the current weights. Upstream's default is True; here False, so that the ViT's conv
# stem does not change behaviour: the configs in configs/dds_baselines set it
_C.BN.USE_PRECISE_STATS = False
_C.BN.NUM_SAMPLES_PRECISE = 8192

# Under TRAIN.PARALLEL ddp: normalise with the statistics of the whole global batch
# (torch.nn.SyncBatchNorm) instead of each process's share (upstream's behaviour, False). CUDA
# only: PyTorch's SyncBatchNorm has no CPU kernel. One process (TRAIN.PARALLEL none) ignores it
_C.BN.SYNC = False


# ------------------------------------------------------------------------------------------------ #
# Optimizer and learning-rate schedule
# ------------------------------------------------------------------------------------------------ #
_C.OPTIM = CfgNode()

# Optimizer: "sgd", "adamw", "lamb" or "muon" (a ViT's hidden 2-D weights on Muon, everything
# else on AdamW; see MUON)
_C.OPTIM.OPTIMIZER = "adamw"

# Learning rate at the end of warmup (for the schedule's reference batch, see OPTIM.LR_SCALE_BATCH)
_C.OPTIM.BASE_LR = 1e-3

# Learning rate the schedule decays to (cosine and linear schedules)
_C.OPTIM.MIN_LR = 1e-5

# Schedule after warmup: "cos", "lin", "steps", "constant", "onecycle" or "cyclic"; updated every
# iteration
_C.OPTIM.LR_POLICY = "cos"

# "steps" schedule: epochs at which the rate is multiplied by LR_MULT
_C.OPTIM.STEPS = []
_C.OPTIM.LR_MULT = 0.1

# Number of training epochs
_C.OPTIM.MAX_EPOCH = 100

# "onecycle": fraction of training spent rising from BASE_LR / ONECYCLE_DIV_FACTOR to BASE_LR, then
# cosine annealing to MIN_LR
_C.OPTIM.ONECYCLE_PCT_START = 0.3
_C.OPTIM.ONECYCLE_DIV_FACTOR = 25.0

# "cyclic": triangular cycles between MIN_LR and BASE_LR, each this many epochs long
_C.OPTIM.CYCLE_EPOCHS = 10.0

# Warmup: the rate rises linearly from WARMUP_FACTOR * BASE_LR to the schedule over WARMUP_EPOCHS
# (fractional epochs allowed)
_C.OPTIM.WARMUP_EPOCHS = 0.0
_C.OPTIM.WARMUP_FACTOR = 0.01

# Linear LR scaling rule: if > 0, BASE_LR and MIN_LR are for this global batch size and are scaled
# by (global batch / LR_SCALE_BATCH); 0 uses BASE_LR as written
_C.OPTIM.LR_SCALE_BATCH = 0

# SGD momentum, dampening and Nesterov
_C.OPTIM.MOMENTUM = 0.9
_C.OPTIM.DAMPENING = 0.0
_C.OPTIM.NESTEROV = True

# Adam-family betas and epsilon (AdamW and LAMB)
_C.OPTIM.BETAS = [0.9, 0.999]
_C.OPTIM.EPS = 1e-8

# Decoupled weight decay (AdamW, LAMB) or L2 (SGD) for weight matrices
_C.OPTIM.WEIGHT_DECAY = 0.05

# Weight decay for norms, biases, position embedding and class token (0 in every modern recipe)
_C.OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP = 0.0

# Keep parameters and gradients as views into one flat buffer per group and dtype, so each fused
# update is one kernel call over the buffer instead of one per tensor. Equal speed on one CPU
# thread; on two threads of a busy CPU several times faster, because a per-tensor update waits at
# one thread barrier per tensor (BENCHMARKS.md)
_C.OPTIM.CONTIGUOUS_PARAMS = False

# Clip the global gradient norm to this value (0 = no clipping)
_C.OPTIM.CLIP_GRAD = 0.0

# Layer-wise learning-rate decay (BEiT/MAE fine-tuning), in (0, 1]: the head trains at the
# scheduled rate, block i (0-based) at LAYER_DECAY ** (VIT.DEPTH - i) times it, the embedding at
# LAYER_DECAY ** (VIT.DEPTH + 1); 1 = the same rate everywhere
_C.OPTIM.LAYER_DECAY = 1.0


# ------------------------------------------------------------------------------------------------ #
# Knowledge distillation from a teacher (DeiT, "Training data-efficient image transformers &
# distillation through attention"): the teacher predicts each training batch (after mixup, in eval
# mode, under the run's AMP level, without gradients) and the loss becomes
# (1 - ALPHA) * the cross-entropy of the class head + ALPHA * the distillation term of the
# distillation head (VIT.DIST_TOKEN; without it, of the one head). The teacher is not trained,
# saved, averaged (EMA) or sharded: every process holds all of it
# ------------------------------------------------------------------------------------------------ #
_C.DISTILL = CfgNode()

# "none", "hard" (cross-entropy with the teacher's top class) or "soft" (KL divergence from the
# teacher's distribution at temperature TAU, times TAU^2, over batch x classes as DeiT divides)
_C.DISTILL.TYPE = "none"

# The teacher: "zoo:NAME" (a pycls zoo model with its published weights, found in or downloaded
# to MODEL.ZOO_DIR: zoo:RegNetY-16GF is DeiT's teacher family), "timm:NAME" (a timm model, e.g.
# timm:regnety_160, with TEACHER_WEIGHTS), or a pycls checkpoint (a .pyth file, a sharded folder, a
# run folder or a model_final.safetensors: the model is rebuilt from the config stored in it)
_C.DISTILL.TEACHER = ""

# A weights file for the teacher: required for timm:NAME (a state dict, possibly under "model",
# as DeiT's regnety_160-a5fe301d.pth), optional for zoo:NAME (instead of the published file)
_C.DISTILL.TEACHER_WEIGHTS = ""

# Weight of the distillation term, in [0, 1] (DeiT: 0.5)
_C.DISTILL.ALPHA = 0.5

# Temperature of soft distillation (DeiT: 1.0)
_C.DISTILL.TAU = 1.0


# ------------------------------------------------------------------------------------------------ #
# Muon (OPTIM.OPTIMIZER muon): the matrices inside the ViT's blocks (attention and feed-forward
# projections) take Muon's orthogonalised momentum; everything else (patch embedding, head, norms,
# biases, position embedding, tokens) takes AdamW at OPTIM.BASE_LR with OPTIM.BETAS, EPS,
# WEIGHT_DECAY and WEIGHT_DECAY_NO_DECAY_GROUP. Both follow the one schedule
# ------------------------------------------------------------------------------------------------ #
_C.MUON = CfgNode()

# The Muon matrices' learning rate as a multiple of the scheduled rate (1 with ADJUST_LR
# match_rms_adamw, Moonlight's recipe: AdamW's rate carries over; about 0.02 / OPTIM.BASE_LR with
# "original", Keller Jordan's)
_C.MUON.LR_MULT = 1.0

# Decoupled weight decay of the Muon matrices (Moonlight: AdamW's)
_C.MUON.WEIGHT_DECAY = 0.05

# Momentum of the gradient before it is orthogonalised, and Nesterov's form of it
_C.MUON.MOMENTUM = 0.95
_C.MUON.NESTEROV = True

# Newton-Schulz iterations of the orthogonalisation (torch.optim.Muon's default)
_C.MUON.NS_STEPS = 5

# Scale of each matrix's update by its shape (out, in): "match_rms_adamw" 0.2 * sqrt(max(out, in))
# (the update's RMS is AdamW's) or "original" sqrt(max(1, out / in))
_C.MUON.ADJUST_LR = "match_rms_adamw"


# ------------------------------------------------------------------------------------------------ #
# Data
# ------------------------------------------------------------------------------------------------ #
_C.DATA = CfgNode()

# Root folder of the data set ("" for the bundled digits and the synthetic set). For imagefolder
# it holds train/ and val/ (TRAIN.SPLIT, TEST.SPLIT); for cifar10/cifar100, the python pickles.
# A folder holding TRAIN.SPLIT (train/) of class sub-folders is an image folder whatever data set
# the config names: TRAIN.DATASET and TEST.DATASET become imagefolder, and a TEST.SPLIT of val or
# test that is not there becomes the other one if that is (use_data_folder).
# Also a path or URL (hf://, http(s)://, s3:// ... through fsspec) of WebDataset tar shards or
# parquet files (DATA_LOADER.BACKEND wds / parquet, detected when BACKEND is torchvision): a
# shard pattern (/data/imagenet-train-{000000..001281}.tar, or a glob), a file, or a folder or
# repository (hf://datasets/timm/imagenet-1k-wds) whose files are named for their splits
# (train-00000-of-00100.parquet, SPLIT/ sub-folders); see docs/data_formats.md
_C.DATA.PATH = ""

# Evaluation shards when DATA.PATH names the training split's only (a pattern or a file): a
# pattern, file or folder of the same convention; "" takes TEST.SPLIT from DATA.PATH's folder
_C.DATA.TEST_PATH = ""

# Per-channel normalisation in 0-1 units, applied on the device; empty lists take the data set's
_C.DATA.MEAN = []
_C.DATA.STD = []

# Keep only these classes (of both splits), relabelled 0, 1, ... in the order given; [] keeps all.
# E.g. pretrain on some classes and fine-tune on the others
_C.DATA.CLASSES = []


# ------------------------------------------------------------------------------------------------ #
# Training
# ------------------------------------------------------------------------------------------------ #
_C.TRAIN = CfgNode()

# Data set: "digits" (bundled), "cifar10", "cifar100", "imagefolder" or "synthetic"
_C.TRAIN.DATASET = "digits"

# Split (sub-folder for imagefolder)
_C.TRAIN.SPLIT = "train"

# Global batch size (split over processes)
_C.TRAIN.BATCH_SIZE = 128

# Training image size (square, pixels)
_C.TRAIN.IM_SIZE = 224

# Augmentation preset: "default" (the data set's own: imagenet, cifar or digits), "imagenet",
# "cifar", "digits", "none", or a recipe that also sets TRAIN.AUTO_AUGMENT/RANDOM_ERASING-style
# defaults for the transform: "deit" (RandAugment 2/9 + erasing 0.25) or "plain_vit" ("Better plain
# ViT baselines": inception crop + flip + RandAugment 2/10)
_C.TRAIN.AUGMENT = "default"

# Label smoothing of the cross-entropy target
_C.TRAIN.LABEL_SMOOTHING = 0.0

# Evaluate every this many epochs (and always after the last)
_C.TRAIN.EVAL_PERIOD = 1

# Save a checkpoint every this many epochs (and always after the last)
_C.TRAIN.CHECKPOINT_PERIOD = 1

# Keep only this many of the newest epoch checkpoints, removing older ones after each save (0 keeps
# all). OUT_DIR/checkpoints/model_best.pyth and OUT_DIR/model_final.safetensors are always kept.
# More than 1 leaves an older checkpoint to resume from should the newest be unreadable
_C.TRAIN.KEEP_CHECKPOINTS = 0

# Resume from the newest checkpoint in OUT_DIR/checkpoints if there is one
_C.TRAIN.AUTO_RESUME = True

# Initialise from these weights before training ("" for random init): a pycls checkpoint (.pyth),
# a .safetensors file, or a torch file holding a plain state dict (or one under "model" /
# "state_dict") in pycls, timm or torchvision naming. A head for another number of classes is
# dropped (the model's own head init is kept, see VIT.HEAD_INIT_SCALE); a position embedding
# for another image size is resampled. Not used when resuming from OUT_DIR/checkpoints
_C.TRAIN.WEIGHTS = ""

# Naming of TRAIN.WEIGHTS: "auto" (detected from the keys), "pycls", "timm" or "torchvision"
_C.TRAIN.WEIGHTS_FORMAT = "auto"

# Train only part of the model, the rest frozen: "none" (train everything), "head" (the
# classifier only: a linear probe) or "last_K" (the last K blocks, the final norm and the head)
_C.TRAIN.FREEZE = "none"

# Parallelism: "none", "ddp", "fsdp", "pipeline" or "tensor" (tensor and sequence parallelism over
# a device mesh, with FSDP2 and pipeline stages: MESH.*)
_C.TRAIN.PARALLEL = "none"

# Compile the model with torch.compile
_C.TRAIN.COMPILE = False

# What TRAIN.COMPILE compiles: "blocks" (each transformer or residual block in place, regional
# compilation: blocks of one shape share one compiled graph, so compiling takes a fraction of the
# time) or "model" (the whole model as one graph)
_C.TRAIN.COMPILE_SCOPE = "blocks"

# Gradient accumulation (>= 1): each optimizer step sums ACCUM_STEPS micro-batches of
# BATCH_SIZE / ACCUM_STEPS images (the same update as one batch of BATCH_SIZE)
_C.TRAIN.ACCUM_STEPS = 1

# Keep an exponential moving average of the weights, evaluated beside the raw model
_C.TRAIN.EMA = False

# EMA decay per optimizer step
_C.TRAIN.EMA_DECAY = 0.9998

# Ramp the decay up as min(EMA_DECAY, (1 + t) / (10 + t)) over the first steps t, so the average
# is not dominated by the random initial weights
_C.TRAIN.EMA_WARMUP = True

# Update the EMA every this many optimizer steps (the decay is adjusted to match)
_C.TRAIN.EMA_PERIOD = 1

# Automatic augmentation policy on top of the preset: "none", "randaugment", "trivialaugment",
# "autoaugment" (torchvision.transforms.v2)
_C.TRAIN.AUTO_AUGMENT = "none"

# RandAugment: number of ops and magnitude (0-30)
_C.TRAIN.RAND_AUGMENT_N = 2
_C.TRAIN.RAND_AUGMENT_M = 9

# Random erasing probability (after the other augmentations)
_C.TRAIN.RANDOM_ERASING = 0.0

# Repeated augmentation: each image appears this many times per epoch with different augmentations
# (DeiT), the epoch keeping its length
_C.TRAIN.REPEATED_AUG = 1

# Token budget (ViT only; 0 = off): patch tokens per optimizer step, all processes together, with
# images of several sizes and aspect ratios in one batch (NaFlex-style). Each step draws a size
# from TOKEN_SIZES (the same in every process); each image gets its own patch grid of at most that
# size's patches (TOKEN_MAX_ASPECT, TOKEN_MIN_SCALE); a micro-batch holds TOKEN_BUDGET /
# (processes x ACCUM_STEPS x the size's patches) sequences of that many patches, one image each
# (padded, with a key-padding mask) or several (TOKEN_PACKING). The learning rate's batch
# (OPTIM.LR_SCALE_BATCH) is TOKEN_BUDGET / (TRAIN.IM_SIZE / VIT.PATCH_SIZE)^2 images, and
# TRAIN.BATCH_SIZE is not used for training. Evaluation is as without it (TEST.IM_SIZE, square)
_C.TRAIN.TOKEN_BUDGET = 0

# The sizes (square sides in pixels, multiples of VIT.PATCH_SIZE) a step's images are capped at,
# one drawn per step; [] = [TRAIN.IM_SIZE]
_C.TRAIN.TOKEN_SIZES = []

# Each image's aspect ratio (height / width of its patch grid) is drawn log-uniformly in
# [1 / TOKEN_MAX_ASPECT, TOKEN_MAX_ASPECT] (>= 1; 1: square)
_C.TRAIN.TOKEN_MAX_ASPECT = 1.0

# Each image's patches are drawn uniformly in [TOKEN_MIN_SCALE, 1] x the step's cap (in (0, 1];
# 0.25 makes sides vary 2x; 1: every image at the cap)
_C.TRAIN.TOKEN_MIN_SCALE = 1.0

# Pack several images into each sequence (NaViT) instead of padding each to the cap: attention
# stays inside each image (VIT.PACKED_ATTENTION), pooling is per image
_C.TRAIN.TOKEN_PACKING = False


# ------------------------------------------------------------------------------------------------ #
# Testing
# ------------------------------------------------------------------------------------------------ #
_C.TEST = CfgNode()

# Data set and split for evaluation (same names as TRAIN.DATASET)
_C.TEST.DATASET = "digits"
_C.TEST.SPLIT = "test"

# Global batch size for evaluation
_C.TEST.BATCH_SIZE = 256

# Evaluation image size (square, pixels). A config that does not set it evaluates at
# TRAIN.IM_SIZE, as upstream pycls and timm do (0 says the same); config.yaml records the size
_C.TEST.IM_SIZE = 224

# Weights evaluated by --mode test (a pycls checkpoint)
_C.TEST.WEIGHTS = ""


# ------------------------------------------------------------------------------------------------ #
# Fully sharded data parallel (TRAIN.PARALLEL fsdp)
# ------------------------------------------------------------------------------------------------ #
_C.FSDP = CfgNode()

# Engine: "torch" (FSDP2, fully_shard per transformer block and on the root; CPU or CUDA) or
# "fairscale" (FairScale FullyShardedDataParallel per block; CUDA only)
_C.FSDP.BACKEND = "torch"

# Free each block's gathered parameters after its forward and gather them again for the backward
# (less memory); False keeps them from the forward to the backward (less communication)
_C.FSDP.RESHARD_AFTER_FORWARD = True

# Keep the sharded parameters, gradients and optimizer state in host memory; the optimizer then
# steps on the CPU (torch: CPUOffloadPolicy; fairscale: move_params_to_cpu)
_C.FSDP.CPU_OFFLOAD = False


# ------------------------------------------------------------------------------------------------ #
# Pipeline parallel (TRAIN.PARALLEL pipeline)
# ------------------------------------------------------------------------------------------------ #
_C.PIPELINE = CfgNode()

# Pipeline ranks: the ViT's blocks are spread over this many processes; the processes are
# STAGES x replicas, the replicas being data-parallel (DDP over the same stage)
_C.PIPELINE.STAGES = 2

# Model chunks per pipeline rank (virtual stages): 1 for gpipe and 1f1b, 2 or more for
# interleaved_1f1b; the ViT is cut into STAGES x STAGES_PER_RANK chunks (at most VIT.DEPTH)
_C.PIPELINE.STAGES_PER_RANK = 1

# How chunks are balanced: "blocks" (equal block counts) or "params" (equal parameter counts, the
# embedding counted in the first chunk and the head in the last)
_C.PIPELINE.BALANCE = "blocks"

# Micro-batches per step; the batch per replica (TRAIN.BATCH_SIZE / replicas) must split into them
_C.PIPELINE.MICRO_BATCHES = 4

# Schedule: "gpipe" (all forwards, then all backwards), "1f1b" (one forward one backward: fewer
# activations alive) or "interleaved_1f1b" (1F1B over several chunks per rank: smaller bubble)
_C.PIPELINE.SCHEDULE = "1f1b"


# ------------------------------------------------------------------------------------------------ #
# Device mesh (TRAIN.PARALLEL tensor): MESH.PP x MESH.DP x MESH.TP processes
# ------------------------------------------------------------------------------------------------ #
_C.MESH = CfgNode()

# Tensor-parallel processes per model replica: each block's attention heads and MLP hidden
# channels are split over them (qkv and fc1 column-wise, proj and fc2 row-wise) and its
# LayerNorms, dropouts and residual stream over the tokens (sequence parallelism); the embedding
# and the classifier are replicated. Must divide VIT.NUM_HEADS and VIT.MLP_DIM
_C.MESH.TP = 1

# Pipeline stages, cut and scheduled as PIPELINE.* say (PIPELINE.STAGES itself is the pipeline
# engine's key: here MESH.PP is)
_C.MESH.PP = 1

# Data-parallel replicas, over which FSDP2 shards each process's part of the model (FSDP.* apply)
# or, with MESH.PP > 1, which average the gradients of each stage; 0 = the processes left over
# (processes / (TP x PP)). DP x TP x PP must be the number of processes
_C.MESH.DP = 0


# ------------------------------------------------------------------------------------------------ #
# Distributed data parallel (TRAIN.PARALLEL ddp; also the replicas of pipeline stages)
# ------------------------------------------------------------------------------------------------ #
_C.DDP = CfgNode()

# Size of a gradient all-reduce bucket in MiB (buckets are reduced while the backward continues)
_C.DDP.BUCKET_CAP_MB = 25

# Gradients are views into the reduction buckets (saves a copy and the memory of one gradient)
_C.DDP.GRADIENT_AS_BUCKET_VIEW = False

# The set of used parameters and the order of their gradients never change between steps: lets
# DDP skip per-step bookkeeping (and combine with activation checkpointing)
_C.DDP.STATIC_GRAPH = False

# Look for parameters the forward did not use, every step (slower; needed only if some parameters
# get no gradient)
_C.DDP.FIND_UNUSED_PARAMETERS = False


# ------------------------------------------------------------------------------------------------ #
# Data loader
# ------------------------------------------------------------------------------------------------ #
_C.DATA_LOADER = CfgNode()

# Worker processes per training process (0 loads in the main process)
_C.DATA_LOADER.NUM_WORKERS = 4

# Page-locked host memory for faster, asynchronous host-to-device copies
_C.DATA_LOADER.PIN_MEMORY = True

# Keep workers alive between epochs
_C.DATA_LOADER.PERSISTENT_WORKERS = True

# Batches each worker prepares ahead
_C.DATA_LOADER.PREFETCH_FACTOR = 4

# Skip (and count) unreadable or corrupt images instead of stopping with an error
_C.DATA_LOADER.SKIP_CORRUPT = False

# The most pixels an image may declare: more is refused as corrupt before decoding (a 100 KB PNG
# can declare 30000 x 30000, 2.7 GB decoded), skipped under SKIP_CORRUPT. PIL's default (ImageNet's
# largest image has 12.6 million); 0: no limit
_C.DATA_LOADER.MAX_IMAGE_PIXELS = 89_478_485

# Where images come from: "torchvision" (decode what DATA.PATH holds: image folders, CIFAR pickles,
# or the bundled digits), "shards" (memory-mapped shards that tools/prepare_dataset.py wrote
# once into SHARD_PATH; TRAIN.DATASET / TEST.DATASET still name the data set they hold), "wds"
# (WebDataset tar shards at DATA.PATH) or "parquet" (Hugging Face parquet files at DATA.PATH).
# torchvision with a DATA.PATH of tar or parquet files becomes wds or parquet when the config
# loads (a note says so), and TRAIN.DATASET / TEST.DATASET become imagefolder unless they name
# cifar10 / cifar100 (ImageNet's statistics and augmentation, or CIFAR's)
_C.DATA_LOADER.BACKEND = "torchvision"

# The order of a training epoch: "global" (one random permutation of every sample), "shards"
# (the shards in random order, their samples through a shuffle buffer of SHUFFLE_BUFFER; each
# process reads whole batches of consecutive samples: the order WebDataset users stream object
# storage in, reading each stretch of a shard once), "resampled" (shards drawn with replacement,
# as WebDataset's resampled=True, as many samples per epoch as the data holds) or "auto" (shards
# for parquet and for URLs, else global; resolved when the config loads). Every order is drawn
# from RNG_SEED and the epoch, so a resume continues at the exact next sample on any number of
# processes. shards and resampled need BACKEND wds or parquet
_C.DATA_LOADER.ORDER = "auto"

# Samples in the shuffle buffer of ORDER shards / resampled (a sample leaves at most this many
# places early; WebDataset and timm use 8192)
_C.DATA_LOADER.SHUFFLE_BUFFER = 8192

# Folder of the tar shards' indexes (where each sample's image lies in its shard, built once per
# shard by reading it, kept until the shard changes); "" = tar_index/ in pycls's cache folder
# ($PYCLS_CACHE_DIR, else $XDG_CACHE_HOME/pycls, else ~/.cache/pycls)
_C.DATA_LOADER.INDEX_CACHE = ""

# Attempts of a read from a URL (a dropped connection, a short answer) before the run stops with
# an error naming the file and the member
_C.DATA_LOADER.RETRIES = 3

# Folder of prepared shards, one sub-folder per split (train/, val/ or test/), for BACKEND shards
_C.DATA_LOADER.SHARD_PATH = ""

# Where the shards backend augments: "cpu" (per sample in the loader workers, the TRAIN.AUGMENT
# preset), "gpu" (whole batches on the CUDA device after the copy, JPEG shards decoded there too;
# presets imagenet, cifar and none) or "auto" (gpu when training on CUDA with such a preset, else
# cpu). Ignored by BACKEND torchvision
_C.DATA_LOADER.AUGMENT_DEVICE = "auto"


# ------------------------------------------------------------------------------------------------ #
# Mixed precision
# ------------------------------------------------------------------------------------------------ #
_C.AMP = CfgNode()

# Precision level: "O0" fp32; "O1" autocast; "O2" half weights (fp32 norms) + fp32 master weights;
# "O3" everything in half precision
_C.AMP.LEVEL = "O0"

# Half-precision type for O1-O3: "bfloat16" or "float16" (float16 uses dynamic loss scaling)
_C.AMP.DTYPE = "bfloat16"

# Type in which the processes average their gradients, the same under every engine: "float32"
# (half gradients are summed in fp32 and rounded once) or "compute" (in AMP.DTYPE: half the
# traffic, a rounding per addition)
_C.AMP.REDUCE_DTYPE = "float32"

# What tools/run_net.py runs on a CPU device: "auto" (AMP.LEVEL as written where AMP.DTYPE is
# bfloat16 and the CPU computes it natively: AMX, AVX512-BF16 or Arm BF16 in /proc/cpuinfo; fp32
# otherwise, where bfloat16 would be emulated), "O0" (fp32 whatever AMP.LEVEL says) or "same"
# (AMP.LEVEL as written). The run says what it decided on stdout; the resolved AMP.LEVEL is in
# OUT_DIR/config.yaml
_C.AMP.CPU_LEVEL = "auto"

# float8 linear layers through torchao (pip install torchao): "none", "tensorwise" (one scale per
# tensor; under FSDP2 the weights are all-gathered in float8) or "rowwise" (one scale per row:
# closer to bfloat16, more casting). Only the linear layers whose in and out features are both at
# least FLOAT8_MIN_DIM (and multiples of 16) are converted, the heads never; the log lists them.
# Needs float8 matmuls (NVIDIA compute capability 8.9+: Ada, Hopper, Blackwell): refused elsewhere.
# Weights and checkpoints stay as they are (fp32, or AMP.LEVEL's half type)
_C.AMP.FLOAT8 = "none"

# The smallest side a linear layer needs to be converted to float8. torchao's H100 microbenchmarks:
# a (1024 x 2048) x (2048 x 1024) matmul runs at 0.80x of bfloat16, a (4096 x 8192) x (8192 x 16384)
# one at 1.39x, so small layers stay in bfloat16; 2048 lies between the two. Every ViT in configs/
# (width 192-1280, MLP 768-5120) is below it: 0 converts all their blocks' layers
# (docs/float8.md)
_C.AMP.FLOAT8_MIN_DIM = 2048


# ------------------------------------------------------------------------------------------------ #
# Image-size curriculum ("Training a ViT from scratch in less than 24 hours with 1 GPU")
# ------------------------------------------------------------------------------------------------ #
_C.CURRICULUM = CfgNode()

# Train at growing image sizes: START_SIZE, + STEP every EPOCHS_PER_STEP epochs, up to TRAIN.IM_SIZE
_C.CURRICULUM.ENABLED = False

# First training image size (a multiple of VIT.PATCH_SIZE)
_C.CURRICULUM.START_SIZE = 32

# Pixels added at each step (a multiple of VIT.PATCH_SIZE)
_C.CURRICULUM.STEP = 16

# Epochs spent at each size before the next step
_C.CURRICULUM.EPOCHS_PER_STEP = 1

# Grow the batch as the image shrinks so tokens per batch stay about constant (rounded down to a
# multiple of the process count and TRAIN.ACCUM_STEPS)
_C.CURRICULUM.SCALE_BATCH = False

# Evaluate at TEST.IM_SIZE (the final size) rather than at the current training size
_C.CURRICULUM.EVAL_AT_FINAL_SIZE = True


# ------------------------------------------------------------------------------------------------ #
# Mixup and CutMix (on the device, per batch; torchvision.transforms.v2.MixUp / CutMix)
# ------------------------------------------------------------------------------------------------ #
_C.MIXUP = CfgNode()

# Mixup alpha (Beta(alpha, alpha) mixing weight); 0 disables mixup
_C.MIXUP.ALPHA = 0.0

# CutMix alpha; 0 disables cutmix
_C.MIXUP.CUTMIX_ALPHA = 0.0

# Probability of mixing a batch at all
_C.MIXUP.PROB = 1.0

# When both are on: probability of CutMix instead of Mixup for a mixed batch
_C.MIXUP.SWITCH_PROB = 0.5

# Stop mixing from this epoch on (0 = mix until the end), as in late-training clean epochs
_C.MIXUP.OFF_EPOCH = 0


# ------------------------------------------------------------------------------------------------ #
# Learning-rate range test (--mode lrfind)
# ------------------------------------------------------------------------------------------------ #
_C.LRFIND = CfgNode()

# The LR grows exponentially from START_LR to END_LR over NUM_ITERS iterations
_C.LRFIND.START_LR = 1e-7
_C.LRFIND.END_LR = 10.0
_C.LRFIND.NUM_ITERS = 200

# Stop once the smoothed loss exceeds DIVERGE_FACTOR x its minimum
_C.LRFIND.DIVERGE_FACTOR = 4.0

# Exponential smoothing of the loss curve (0 = none)
_C.LRFIND.SMOOTHING = 0.05


# ------------------------------------------------------------------------------------------------ #
# Timing (--mode time)
# ------------------------------------------------------------------------------------------------ #
_C.PREC_TIME = CfgNode()

# Untimed warm-up iterations, then timed iterations
_C.PREC_TIME.WARMUP_ITER = 3
_C.PREC_TIME.NUM_ITER = 10


# ------------------------------------------------------------------------------------------------ #
# Miscellaneous
# ------------------------------------------------------------------------------------------------ #

# Device: "auto" (cuda when available, else cpu), "cpu" or "cuda"
_C.DEVICE = "auto"

# Number of local processes to spawn (1 = this process only)
_C.NUM_PROCS = 1

# CPU threads of each process (torch.set_num_threads). 0 = automatic: OMP_NUM_THREADS if set,
# else a SLURM task's SLURM_CPUS_PER_TASK, else for a process started beside others (torchrun,
# srun, NUM_PROCS) the CPUs of its affinity mask divided by the processes on the machine; a plain
# single process keeps torch's default (one thread per core)
_C.CPU_THREADS = 0

# Output folder for logs, the resolved config, checkpoints and plots
_C.OUT_DIR = "/tmp/pycls"

# Load sharded folders without a manifest.json (an older pycls's, another program's DCP folder):
# nothing in them is verified. A folder pycls sealed is refused without its manifest regardless
_C.ALLOW_UNVERIFIED_CHECKPOINTS = False

# Name of the resolved config written to OUT_DIR
_C.CFG_DEST = "config.yaml"

# Seed of every random generator (python, numpy, torch, data order and augmentation)
_C.RNG_SEED = 1

# Log a train_iter json_stats line (and synchronise the device) every this many iterations
_C.LOG_PERIOD = 10

# Also write the logged scalars (loss, top-1/top-5 error in %, lr, images/s, peak memory in MiB) as
# TensorBoard event files in OUT_DIR/tensorboard (needs the tensorboard package;
# pycls.core.curve_writers)
_C.TENSORBOARD = False

# Also send those scalars to this Weights & Biases project ("" = off; needs the wandb package)
_C.WANDB_PROJECT = ""

# Deterministic algorithms (cudnn.deterministic, no benchmark): slower, bitwise repeatable
_C.DETERMINISTIC = False

DEFAULTS = _C.clone()


def get_default_cfg():
    """A fresh, mutable copy of the defaults."""
    return DEFAULTS.clone()
