"""Vision Transformer ("An image is worth 16x16 words", Dosovitskiy et al., 2021): the model.

One class with explicit keyword arguments (its one argument list, with every default and meaning,
is ``pycls.models.vit.args.VitArgs``); each variant in the literature is a switch: conv stem,
pooled or attention-pool classifier, local or SwiGLU feed-forward, sin-cos, rotary or no position
embedding, QK-norm, LayerScale, parallel blocks, RMSNorm, bias-free projections, and the token
layout (batch first or batch second) carried through the whole encoder.
"""

import functools
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pycls.models.groups import NORM_TYPES
from pycls.models.vit.args import (
    TRAINING_ONLY_ARGS,
    VitArgs,
    check_image_size,
    keyword_signature,
)
from pycls.models.vit.attention_pool import AttentionPool
from pycls.models.vit.blocks import ConvStem, PatchifyStem, build_block
from pycls.models.vit.complexity import vit_complexity
from pycls.models.vit.norms import LayerScale, make_norm
from pycls.models.vit.position import carry_to_new_grid, resample_pos_embed, sincos_pos_embed
from pycls.models.vit.rotary import Rotary, token_positions
from pycls.models.vit.token_masks import TokenBatch, drop_patches, forward_token_batch

# The residual stream's dtype under autocast (VitArgs.residual_dtype): "float32" casts nothing
# (under AMP O1 the stream is float32, as the float32 position embedding makes it; where the
# weights are half it is half); "bfloat16" casts the embedded tokens before the first block
RESIDUAL_TORCH_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


class VisionTransformer(nn.Module):
    """Vision Transformer with pre-norm blocks and a class-token or mean-pooled classifier.

    Submodules: ``patch_embed`` (stem: images -> tokens in the model's layout, no class token),
    ``class_token`` (or None), ``pos_embed`` (parameter or buffer, always (1, L_total, D) so
    checkpoints do not depend on the layout; None with ``pos_embed`` "none"), ``blocks``
    (ModuleList of EncoderBlock or ParallelBlock, tensor in, tensor out), ``norm``,
    ``attn_pool`` (the "map" classifier's, or None), ``pre_logits`` (or None) and ``head`` (an
    identity with ``num_classes`` 0: the model returns its pooled features).

    Args: the fields of ``VitArgs`` (``pycls.models.vit.args``) as keyword arguments, each with
    its default and meaning there, or a ``VitArgs`` record (``VisionTransformer(args)``); the
    record is ``model.args`` (``model.arch``: the same as a dict).

    ``forward`` takes a batch tensor (N, C, H, W), square or not (the position embedding is
    resampled to the grid), or a ``TokenBatch`` (``pycls.models.vit.token_masks``).
    """

    # Arguments that leave the parameters (names, shapes, what they compute) as they are: a
    # checkpoint resumes under other values (the image size resamples the position embedding)
    TRAINING_ONLY_ARGS = TRAINING_ONLY_ARGS

    def __init__(self, args: VitArgs | None = None, /, **kwargs):
        super().__init__()
        # The one argument record: the analytic complexity, the exports and the config's resume
        # check read the model's own arguments, so they cannot drift
        self.args = a = VitArgs.of(args, **kwargs).check()
        image_size, patch_size, width, depth = a.image_size, a.patch_size, a.width, a.depth
        class_token, dist_token, num_registers = a.class_token, a.dist_token, a.num_registers
        classifier, layout, pos_embed, norm_eps = a.classifier, a.layout, a.pos_embed, a.norm_eps
        self.image_size = image_size
        self.patch_size = patch_size
        self.grid_size = image_size // patch_size
        self.width = width
        self.classifier = classifier
        self.layout = layout
        self.batch_first = layout == "batch_first"
        self.pos_embed_kind = pos_embed
        self.num_prefix_tokens = int(class_token) + int(dist_token) + num_registers
        self.dist_index = int(class_token)  # the distillation token follows the class token
        self.distilled_training = False
        self.checkpoint_blocks = a.checkpoint_blocks
        self.head_init_scale = a.head_init_scale
        self.patch_drop = a.patch_drop
        self.packed_attention = a.packed_attention
        self.residual_dtype = RESIDUAL_TORCH_DTYPES[a.residual_dtype]

        if a.stem == "patchify":
            self.patch_embed = PatchifyStem(
                in_channels=a.in_channels,
                width=width,
                patch_size=patch_size,
                batch_first=self.batch_first,
                bias=not a.pre_norm,
            )
        else:
            self.patch_embed = ConvStem(
                in_channels=a.in_channels,
                width=width,
                channels=a.conv_stem_channels,
                kernels=a.conv_stem_kernels,
                strides=a.conv_stem_strides,
                batch_first=self.batch_first,
            )
        if class_token:
            self.class_token = nn.Parameter(torch.zeros(1, 1, width))
        else:
            self.register_parameter("class_token", None)
        if dist_token:
            self.dist_token = nn.Parameter(torch.zeros(1, 1, width))
        else:
            self.register_parameter("dist_token", None)
        if num_registers:
            self.register_tokens = nn.Parameter(torch.zeros(1, num_registers, width))
        else:
            self.register_parameter("register_tokens", None)
        table_shape = (1, self.num_prefix_tokens + self.grid_size**2, width)
        if pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(table_shape))
        elif pos_embed == "none":
            self.register_parameter("pos_embed", None)
        else:
            # Persistent, so checkpoints hold `pos_embed` whatever its kind and a model
            # materialised from the meta device gets the table back from its checkpoint.
            self.register_buffer("pos_embed", torch.zeros(table_shape))
        self.pos_drop = nn.Dropout(a.dropout)
        norm = functools.partial(make_norm, a.norm_layer, eps=norm_eps)
        self.norm_pre = norm(width) if a.pre_norm else nn.Identity()
        self.blocks = nn.ModuleList(
            build_block(
                a, i, num_prefix_tokens=self.num_prefix_tokens, batch_first=self.batch_first
            )  # fmt: skip
            for i in range(depth)
        )
        self.norm = nn.Identity() if a.fc_norm else norm(width)
        self.attn_pool = None
        if classifier == "map":
            self.attn_pool = AttentionPool(width=width, num_heads=a.num_heads, mlp_dim=a.mlp_dim,
                                           norm=norm, batch_first=self.batch_first)  # fmt: skip
        self.fc_norm = norm(width) if a.fc_norm else nn.Identity()
        head_in = width
        if a.representation_size is None:
            self.pre_logits = None
        else:
            self.pre_logits = nn.Sequential(nn.Linear(width, a.representation_size), nn.Tanh())
            head_in = a.representation_size
        self.head = _head(head_in, a.num_classes)
        self.head_dist = _head(head_in, a.num_classes) if dist_token else None
        self.init_weights()

    @property
    def arch(self) -> dict:
        """The model's arguments (``self.args``) as a dict."""
        return self.args.as_dict()

    # ---- initialisation -------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise every parameter and buffer; also call after ``to_empty()``."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Conv2d):
                # LeCun normal (variance-preserving without a ReLU after it): the patchify
                # projection, the depthwise conv and the conv stem's last 1x1 conv.
                fan_in = module.weight[0].numel()
                nn.init.trunc_normal_(module.weight, std=math.sqrt(1.0 / fan_in))
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, NORM_TYPES):
                module.reset_parameters()
        if isinstance(self.patch_embed, ConvStem):
            for layer in self.patch_embed.body:
                # He init: these convs feed a BatchNorm + ReLU.
                nn.init.kaiming_normal_(layer.conv.weight, mode="fan_out", nonlinearity="relu")
        for token in (self.class_token, self.dist_token, self.register_tokens):
            if token is not None:
                nn.init.trunc_normal_(token, std=0.02)
        if self.pos_embed_kind == "learned":
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        elif self.pos_embed_kind == "sincos":
            self.pos_embed.copy_(self._sincos_table(self.grid_size))
        self._init_block_options()
        self.reset_head_parameters()

    def _init_block_options(self) -> None:
        """The options' own parameters: LayerScale's initial value, a mixed RoPE's frequencies
        (random directions), the attention pool's probe, the biases outside a Linear (EVA's q
        and v biases, the parallel block's MLP bias) zero."""
        for module in self.modules():
            if isinstance(module, LayerScale | Rotary):
                module.reset_parameters()
            for name in ("q_bias", "v_bias", "mlp_bias"):
                bias = getattr(module, name, None)
                if isinstance(bias, nn.Parameter):
                    nn.init.zeros_(bias)
        if self.attn_pool is not None:
            self.attn_pool.reset_latent()

    @torch.no_grad()
    def reset_head_parameters(self) -> None:
        """Initialise the classifier head as ``head_init_scale`` says (zero by default)."""
        # A zero head starts every class at the same logit, as torchvision does.
        for head in (self.head, self.head_dist):
            if not isinstance(head, nn.Linear):
                continue
            if self.head_init_scale > 0:
                nn.init.trunc_normal_(head.weight, std=0.02 * self.head_init_scale)
            else:
                nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    def _sincos_table(self, grid: int) -> torch.Tensor:
        """The fixed table for ``grid``, with zeros in the class-token slot, (1, L, D)."""
        table = sincos_pos_embed(grid, self.width)
        prefix = table.new_zeros(self.num_prefix_tokens, self.width)
        return torch.cat([prefix, table])[None].to(self.pos_embed.device, self.pos_embed.dtype)

    # ---- forward --------------------------------------------------------------------------

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (N, C, H, W) -> tokens with class token and position embedding added."""
        return self.embed_with_positions(x)[0]

    def embed_with_positions(self, x: torch.Tensor):
        """Images (N, C, H, W) -> (tokens, positions): the embedded tokens, and the coordinates
        of each for a rotary attention ((L, 2) for the batch, (N, L, 2) once patch dropout has
        kept each image's own patches; None without RoPE)."""
        tokens = self.patch_embed(x)
        n = x.shape[0]
        tokens_before = (self.class_token, self.dist_token, self.register_tokens)
        prefix = [t for t in tokens_before if t is not None]
        if prefix:
            if self.batch_first:
                prefix = [t.expand(n, -1, -1) for t in prefix]
                tokens = torch.cat([*prefix, tokens], dim=1)
            else:
                prefix = [t.transpose(0, 1).expand(-1, n, -1) for t in prefix]
                tokens = torch.cat([*prefix, tokens], dim=0)
        h, w = (side // self.patch_size for side in x.shape[-2:])
        pos = self._pos_embed_for(x.shape[-2:])
        if pos is not None:
            # (1, L, D) -> (L, 1, D) by squeeze/unsqueeze, not transpose: the gradient then
            # comes back with the table's own strides, as DDP's gradient buckets expect
            pos = pos if self.batch_first else pos.squeeze(0).unsqueeze(1)
            tokens = tokens + pos
        x = self.pos_drop(tokens)
        positions = None
        if self.args.rope != "none":
            positions = self.rope_positions(h, w, device=x.device)
        if self.training and self.patch_drop > 0:
            x, kept = drop_patches(x, self.patch_drop, self.num_prefix_tokens, self.batch_first,
                                   return_index=True)  # fmt: skip
            positions = None if positions is None else positions[kept]
        return self.to_residual(self.norm_pre(x)), positions

    def rope_positions(self, h: int, w: int, device=None) -> torch.Tensor:
        """The coordinates of the prefix tokens and an h x w grid of patches, (L, 2), on
        ``device``, for the rotary attention (``pycls.models.vit.rotary``)."""
        a = self.args
        return token_positions(a.rope, h, w, self.num_prefix_tokens, ref_grid=a.rope_ref_grid,
                               indexing=a.rope_grid_indexing, device=device)  # fmt: skip

    def to_residual(self, x: torch.Tensor) -> torch.Tensor:
        """Embedded tokens in the residual stream's dtype (``residual_dtype``): cast under
        autocast only, where the blocks' layers take any input dtype."""
        if self.residual_dtype is None or not torch.is_autocast_enabled(x.device.type):
            return x
        return x.to(self.residual_dtype)

    def _pos_embed_for(self, spatial: tuple[int, int]) -> torch.Tensor:
        """The table for an input of this spatial size: the stored one, or one made for it.

        Another size (evaluating at the final size during a curriculum, testing at a new size,
        a non-square image) resamples the table on the fly without touching the stored one:
        differentiable, no state change. ``set_image_size`` is for switching for good.
        """
        if tuple(spatial) == (self.image_size, self.image_size):
            return self.pos_embed
        h, w = spatial
        if h != w and self.args.ffn == "local":
            raise ValueError(f"ffn 'local' needs a square input, got spatial size {(h, w)}")
        check_image_size(h, self.patch_size)
        check_image_size(w, self.patch_size)
        grid = h // self.patch_size if h == w else (h // self.patch_size, w // self.patch_size)
        if self.pos_embed_kind == "learned":
            return self._resampled_table(grid)
        return None if self.pos_embed is None else self._sincos_table(grid)

    def _resampled_table(self, grid) -> torch.Tensor:
        """The learned table resampled to ``grid`` (differentiable; the stored one untouched).
        A parallel plan whose table is a DTensor gives its own (pycls.models.vit.tensor_plan)."""
        return resample_pos_embed(self.pos_embed, grid, num_prefix_tokens=self.num_prefix_tokens)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> encoded tokens (before the final norm), in the model's layout."""
        x, positions = self.embed_with_positions(x)
        return self.run_blocks(x, positions=positions)

    def run_blocks(self, x: torch.Tensor, attn_mask=None, positions=None) -> torch.Tensor:
        """Embedded tokens through every block (the first ``checkpoint_blocks`` recomputed in the
        backward); ``attn_mask`` keeps attention inside each image of a token batch,
        ``positions`` are the tokens' coordinates for a rotary attention."""
        recompute = self.training and torch.is_grad_enabled()
        extra = () if attn_mask is None else (attn_mask,)
        if positions is not None:
            extra = (attn_mask, positions)
        for i, block in enumerate(self.blocks):
            if recompute and i < self.checkpoint_blocks:
                x = checkpoint(block, x, *extra, use_reentrant=False)
            else:
                x = block(x, *extra)
        return x

    def forward_head(self, tokens: torch.Tensor, *, pre_logits: bool = False) -> torch.Tensor:
        """Encoded tokens -> logits (or the features the head sees, with ``pre_logits``)."""
        x = normed = self.norm(tokens)
        seq_dim = 1 if self.batch_first else 0
        if self.classifier == "token":
            x = x.select(seq_dim, 0)
        elif self.classifier == "map":
            x = self.attn_pool(x)
        else:
            x = x.narrow(seq_dim, self.num_prefix_tokens, x.shape[seq_dim] - self.num_prefix_tokens)
            x = x.mean(dim=seq_dim)
        dist = normed.select(seq_dim, self.dist_index) if self.head_dist is not None else None
        return self.classify(x, dist, pre_logits=pre_logits)

    def classify(
        self, x: torch.Tensor, dist: torch.Tensor | None = None, *, pre_logits: bool = False
    ) -> torch.Tensor:
        """Pooled features (N, D) -> logits (or the features the head sees, with ``pre_logits``);
        ``dist``: the distillation token's features (N, D), for a model with one."""
        x = self.fc_norm(x)
        if self.head_dist is not None:
            return self._distilled_head(x, dist, pre_logits)
        if self.pre_logits is not None:
            x = self.pre_logits(x)
        return x if pre_logits else self.head(x)

    def _distilled_head(self, x: torch.Tensor, dist: torch.Tensor, pre_logits: bool):
        """The class head on ``x`` and the distillation head on the distillation token: a pair
        of logits while distilled training, else their mean (DeiT's prediction)."""
        dist = self.fc_norm(dist)
        if pre_logits:
            return (x + dist) / 2
        x, dist = self.head(x), self.head_dist(dist)
        if self.distilled_training and self.training:
            return x, dist
        return (x + dist) / 2

    def set_distilled_training(self, enable: bool = True) -> None:
        """With a distillation token: a training forward returns both heads' logits (the
        distillation loss needs them apart), as timm's ``set_distilled_training``."""
        if enable and self.head_dist is None:
            raise ValueError("distilled training needs the distillation token (dist_token=True)")
        self.distilled_training = enable

    def forward(self, x: torch.Tensor | TokenBatch) -> torch.Tensor:
        if isinstance(x, TokenBatch):
            return forward_token_batch(self, x)
        return self.forward_head(self.forward_features(x))

    def set_patch_drop(self, rate: float) -> None:
        """Patch dropout from now on (a schedule's rate for the next epoch); 0 turns it off."""
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"patch_drop must be in [0, 1), got {rate}")
        if rate > 0 and self.args.ffn == "local":
            raise ValueError("patch_drop needs ffn 'mlp' (ffn 'local' convolves the whole grid)")
        self.patch_drop = rate
        self.args.patch_drop = rate

    # ---- image size -----------------------------------------------------------------------

    @torch.no_grad()
    def set_image_size(self, image_size: int, optimizer=None, ema=None) -> None:
        """Switch to square images of ``image_size`` px, resampling the position embedding.

        A learned table is resampled bicubically in place (the same Parameter object, so
        optimizers holding it stay valid); a sin-cos table is recomputed. In training (the
        image-size curriculum), ``optimizer``'s state of the table and ``ema``'s copy are carried
        to the new grid too (``position.carry_to_new_grid``). Without a table (``pos_embed``
        "none") only the size changes: a rotary attention's positions follow each input's grid.
        """
        check_image_size(image_size, self.patch_size)
        grid = image_size // self.patch_size
        self.image_size, self.grid_size, self.args.image_size = image_size, grid, image_size
        if self.pos_embed is None:
            return
        old_shape = tuple(self.pos_embed.shape)
        if isinstance(self.pos_embed, nn.Parameter):
            self.pos_embed.grad = None  # a gradient of the old shape is meaningless now
        if self.pos_embed_kind == "learned":
            self.pos_embed.data = resample_pos_embed(
                self.pos_embed.data, grid, num_prefix_tokens=self.num_prefix_tokens
            )
        else:
            self.pos_embed = self._sincos_table(grid)
        if optimizer is not None or ema is not None:
            carry_to_new_grid(self, old_shape, optimizer, ema)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args):
        # A checkpoint trained at another image size carries a table for another grid:
        # resample it (learned) or recompute ours (sin-cos) before the normal copy.
        key = prefix + "pos_embed"
        incoming = state_dict.get(key)
        own = self.pos_embed
        if (
            own is not None
            and incoming is not None
            and incoming.ndim == 3
            and (incoming.shape != own.shape)
        ):
            patches = incoming.shape[1] - self.num_prefix_tokens
            if (
                patches > 0
                and math.isqrt(patches) ** 2 == patches
                and incoming.shape[2] == own.shape[2]
            ):
                if self.pos_embed_kind == "learned":
                    state_dict[key] = resample_pos_embed(
                        incoming, self.grid_size, num_prefix_tokens=self.num_prefix_tokens
                    )
                else:
                    state_dict[key] = own.detach().clone()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args)

    # ---- helpers for the engines, the optimizer and the info tools -------------------------

    def repeated_blocks(self) -> list[nn.Module]:
        """The transformer blocks, in order: the units FSDP shards one at a time and regional
        compilation compiles (one compiled graph serves every block of the same shape)."""
        return list(self.blocks)

    def no_weight_decay_names(self) -> set[str]:
        """Names of parameters to exclude from weight decay.

        Biases, norm weights and LayerScales (any parameter with ndim <= 1, and every parameter
        of a norm module), the position embedding, the class, distillation and register tokens,
        the attention pool's probe and a mixed RoPE's frequencies (as timm's ``rope.freqs``).
        """
        probe = None if self.attn_pool is None else self.attn_pool.latent
        tokens = (self.pos_embed, self.class_token, self.dist_token, self.register_tokens, probe)
        exempt = {id(p) for p in tokens if isinstance(p, nn.Parameter)}
        for module in self.modules():
            for p in module.parameters(recurse=False):
                if p.ndim <= 1 or isinstance(module, (*NORM_TYPES, Rotary)):
                    exempt.add(id(p))
        return {name for name, p in self.named_parameters() if id(p) in exempt}

    def complexity(self, image_size: int | None = None) -> dict[str, int]:
        """Per-image ``dict(flops, params, acts)``; see ``pycls.models.vit.complexity``.

        The classifier is counted as the model has it now: a head set by ``reset_classifier``
        or assigned directly (``model.head = nn.Linear(...)``, ``nn.Identity()``) counts its own
        linear layers and parameters.
        """
        if image_size is not None:
            check_image_size(image_size, self.patch_size)
        # everything but the head, analytically
        cx = vit_complexity(self.args, num_classes=0, image_size=image_size or self.image_size)
        for head in (self.head, self.head_dist):
            if head is None:
                continue
            cx["params"] += sum(p.numel() for p in head.parameters())
            for layer in head.modules():
                if isinstance(layer, nn.Linear):
                    cx["flops"] += layer.in_features * layer.out_features
                    cx["acts"] += layer.out_features
        return cx

    # ---- the classifier -------------------------------------------------------------------

    @property
    def num_classes(self) -> int:
        """Outputs of the head (0 when the head is ``nn.Identity``: the model gives features)."""
        return getattr(self.head, "out_features", 0)

    def get_classifier(self) -> nn.Module:
        return self.head

    @torch.no_grad()
    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new, freshly initialised head with ``num_classes`` outputs (0: ``nn.Identity``, the
        model then returns the pooled features), as timm's ``reset_classifier``.

        ``global_pool`` may only name the pooling the model already has (``"token"`` for the
        class-token classifier, ``"avg"`` for the pooled one): switching adds or removes the
        class token, which changes the whole model.
        """
        own = "token" if self.classifier == "token" else "avg"
        if global_pool is not None and global_pool != own:
            raise ValueError(
                f"global_pool {global_pool!r}: this model pools with {own!r} (classifier "
                f"{self.classifier!r}); build a new VisionTransformer to change it"
            )
        if num_classes < 0:
            raise ValueError(f"num_classes must be >= 0, got {num_classes}")
        head_in = self.width if self.pre_logits is None else self.pre_logits[0].out_features
        old = self.head.weight if isinstance(self.head, nn.Linear) else None
        heads = ["head"] + (["head_dist"] if self.head_dist is not None else [])
        for name in heads:  # a distilled model's two heads predict the same classes
            if num_classes == 0:
                setattr(self, name, nn.Identity())
                continue
            like = old if old is not None else self.patch_embed.proj.weight
            head = nn.Linear(head_in, num_classes, device=like.device, dtype=like.dtype)
            nn.init.trunc_normal_(head.weight, std=0.02)
            nn.init.zeros_(head.bias)
            setattr(self, name, head)
        self.args.num_classes = num_classes


# Its keyword arguments as help() and editors show them: the fields of VitArgs, the one list
VisionTransformer.__signature__ = keyword_signature()


def _head(width: int, num_classes: int) -> nn.Module:
    """The classifier: a Linear, or an identity for ``num_classes`` 0 (the model then returns
    its pooled features, as timm's)."""
    return nn.Linear(width, num_classes) if num_classes else nn.Identity()
