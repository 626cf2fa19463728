"""The published models of upstream pycls's zoo, by upstream's names ("RegNetY-800MF",
"ResNet-50"): each one's family and constructor arguments, training image size, weight file and
upstream's top-1 error (``pycls.models.zoo`` builds them and fetches their weights). Plain data, no
torch: the config checks a zoo:NAME when it loads.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One published model: its family and constructor arguments, the training image size, the
    weight file under URL_PREFIX ("<model id>/<file>") and upstream's top-1 error (%)."""

    family: str
    args: dict
    image_size: int
    weights: str
    top1_err: float


def _resnet(depths, resnext=False):
    """Upstream's ResNet (1x64d) and ResNeXt (32x4d) as AnyNet arguments."""
    return dict(
        stem_type="res_stem_in",
        stem_w=64,
        block_type="res_bottleneck_block",
        depths=depths,
        widths=(256, 512, 1024, 2048),
        strides=(1, 2, 2, 2),
        bot_muls=(0.5,) * 4 if resnext else (0.25,) * 4,
        group_ws=(4, 8, 16, 32) if resnext else (64, 128, 256, 512),
    )


def _effnet(stem_w, depths, widths, head_w):
    return dict(
        stem_w=stem_w,
        depths=depths,
        widths=widths,
        exp_ratios=(1, 6, 6, 6, 6, 6, 6),
        strides=(1, 2, 2, 2, 1, 2, 1),
        kernels=(3, 3, 5, 3, 5, 5, 3),
        head_w=head_w,
    )


# RegNetY is RegNetX with squeeze-excitation (se_r=0.25); top1_err from dev/model_error.json
ZOO = {
    "RegNetX-200MF": ZooModel(
        "regnet",
        dict(w_a=36.44, w_0=24, w_m=2.49, depth=13, group_w=8),
        224,
        "160905981/RegNetX-200MF_dds_8gpu.pyth",
        31.088,
    ),
    "RegNetX-400MF": ZooModel(
        "regnet",
        dict(w_a=24.48, w_0=24, w_m=2.54, depth=22, group_w=16),
        224,
        "160905967/RegNetX-400MF_dds_8gpu.pyth",
        27.382,
    ),
    "RegNetX-600MF": ZooModel(
        "regnet",
        dict(w_a=36.97, w_0=48, w_m=2.24, depth=16, group_w=24),
        224,
        "160906442/RegNetX-600MF_dds_8gpu.pyth",
        25.864,
    ),
    "RegNetX-800MF": ZooModel(
        "regnet",
        dict(w_a=35.73, w_0=56, w_m=2.28, depth=16, group_w=16),
        224,
        "160906036/RegNetX-800MF_dds_8gpu.pyth",
        24.846,
    ),
    "RegNetX-1.6GF": ZooModel(
        "regnet",
        dict(w_a=34.01, w_0=80, w_m=2.25, depth=18, group_w=24),
        224,
        "160990626/RegNetX-1.6GF_dds_8gpu.pyth",
        23.038,
    ),
    "RegNetX-3.2GF": ZooModel(
        "regnet",
        dict(w_a=26.31, w_0=88, w_m=2.25, depth=25, group_w=48),
        224,
        "160906139/RegNetX-3.2GF_dds_8gpu.pyth",
        21.736,
    ),
    "RegNetX-4.0GF": ZooModel(
        "regnet",
        dict(w_a=38.65, w_0=96, w_m=2.43, depth=23, group_w=40),
        224,
        "160906383/RegNetX-4.0GF_dds_8gpu.pyth",
        21.356,
    ),
    "RegNetX-6.4GF": ZooModel(
        "regnet",
        dict(w_a=60.83, w_0=184, w_m=2.07, depth=17, group_w=56),
        224,
        "161116590/RegNetX-6.4GF_dds_8gpu.pyth",
        20.844,
    ),
    "RegNetX-8.0GF": ZooModel(
        "regnet",
        dict(w_a=49.56, w_0=80, w_m=2.88, depth=23, group_w=120),
        224,
        "161107726/RegNetX-8.0GF_dds_8gpu.pyth",
        20.728,
    ),
    "RegNetX-12GF": ZooModel(
        "regnet",
        dict(w_a=73.36, w_0=168, w_m=2.37, depth=19, group_w=112),
        224,
        "160906020/RegNetX-12GF_dds_8gpu.pyth",
        20.288,
    ),
    "RegNetX-16GF": ZooModel(
        "regnet",
        dict(w_a=55.59, w_0=216, w_m=2.1, depth=22, group_w=128),
        224,
        "158460855/RegNetX-16GF_dds_8gpu.pyth",
        19.956,
    ),
    "RegNetX-32GF": ZooModel(
        "regnet",
        dict(w_a=69.86, w_0=320, w_m=2.0, depth=23, group_w=168),
        224,
        "158188473/RegNetX-32GF_dds_8gpu.pyth",
        19.498,
    ),
    "RegNetY-200MF": ZooModel(
        "regnet",
        dict(w_a=36.44, w_0=24, w_m=2.49, depth=13, group_w=8, se_r=0.25),
        224,
        "176245422/RegNetY-200MF_dds_8gpu.pyth",
        29.658,
    ),
    "RegNetY-400MF": ZooModel(
        "regnet",
        dict(w_a=27.89, w_0=48, w_m=2.09, depth=16, group_w=8, se_r=0.25),
        224,
        "160906449/RegNetY-400MF_dds_8gpu.pyth",
        25.898,
    ),
    "RegNetY-600MF": ZooModel(
        "regnet",
        dict(w_a=32.54, w_0=48, w_m=2.32, depth=15, group_w=16, se_r=0.25),
        224,
        "160981443/RegNetY-600MF_dds_8gpu.pyth",
        24.54,
    ),
    "RegNetY-800MF": ZooModel(
        "regnet",
        dict(w_a=38.84, w_0=56, w_m=2.4, depth=14, group_w=16, se_r=0.25),
        224,
        "160906567/RegNetY-800MF_dds_8gpu.pyth",
        23.684,
    ),
    "RegNetY-1.6GF": ZooModel(
        "regnet",
        dict(w_a=20.71, w_0=48, w_m=2.65, depth=27, group_w=24, se_r=0.25),
        224,
        "160906681/RegNetY-1.6GF_dds_8gpu.pyth",
        22.066,
    ),
    "RegNetY-3.2GF": ZooModel(
        "regnet",
        dict(w_a=42.63, w_0=80, w_m=2.66, depth=21, group_w=24, se_r=0.25),
        224,
        "160906834/RegNetY-3.2GF_dds_8gpu.pyth",
        21.074,
    ),
    "RegNetY-4.0GF": ZooModel(
        "regnet",
        dict(w_a=31.41, w_0=96, w_m=2.24, depth=22, group_w=64, se_r=0.25),
        224,
        "160906838/RegNetY-4.0GF_dds_8gpu.pyth",
        20.64,
    ),
    "RegNetY-6.4GF": ZooModel(
        "regnet",
        dict(w_a=33.22, w_0=112, w_m=2.27, depth=25, group_w=72, se_r=0.25),
        224,
        "160907112/RegNetY-6.4GF_dds_8gpu.pyth",
        20.11,
    ),
    "RegNetY-8.0GF": ZooModel(
        "regnet",
        dict(w_a=76.82, w_0=192, w_m=2.19, depth=17, group_w=56, se_r=0.25),
        224,
        "161160905/RegNetY-8.0GF_dds_8gpu.pyth",
        20.052,
    ),
    "RegNetY-12GF": ZooModel(
        "regnet",
        dict(w_a=73.36, w_0=168, w_m=2.37, depth=19, group_w=112, se_r=0.25),
        224,
        "160907100/RegNetY-12GF_dds_8gpu.pyth",
        19.67,
    ),
    "RegNetY-16GF": ZooModel(
        "regnet",
        dict(w_a=106.23, w_0=200, w_m=2.48, depth=18, group_w=112, se_r=0.25),
        224,
        "161303400/RegNetY-16GF_dds_8gpu.pyth",
        19.608,
    ),
    "RegNetY-32GF": ZooModel(
        "regnet",
        dict(w_a=115.89, w_0=232, w_m=2.53, depth=20, group_w=232, se_r=0.25),
        224,
        "161277763/RegNetY-32GF_dds_8gpu.pyth",
        19.066,
    ),
    "ResNet-50": ZooModel(
        "anynet",
        _resnet((3, 4, 6, 3), resnext=False),
        224,
        "161235311/R-50-1x64d_dds_8gpu.pyth",
        23.19,
    ),
    "ResNet-101": ZooModel(
        "anynet",
        _resnet((3, 4, 23, 3), resnext=False),
        224,
        "161167170/R-101-1x64d_dds_8gpu.pyth",
        21.414,
    ),
    "ResNet-152": ZooModel(
        "anynet",
        _resnet((3, 8, 36, 3), resnext=False),
        224,
        "161167467/R-152-1x64d_dds_8gpu.pyth",
        20.87,
    ),
    "ResNeXt-50": ZooModel(
        "anynet",
        _resnet((3, 4, 6, 3), resnext=True),
        224,
        "161167411/X-50-32x4d_dds_8gpu.pyth",
        21.884,
    ),
    "ResNeXt-101": ZooModel(
        "anynet",
        _resnet((3, 4, 23, 3), resnext=True),
        224,
        "161167590/X-101-32x4d_dds_8gpu.pyth",
        20.664,
    ),
    "ResNeXt-152": ZooModel(
        "anynet",
        _resnet((3, 8, 36, 3), resnext=True),
        224,
        "162471172/X-152-32x4d_dds_8gpu.pyth",
        20.386,
    ),
    "EfficientNet-B0": ZooModel(
        "effnet",
        _effnet(32, (1, 2, 2, 3, 3, 4, 1), (16, 24, 40, 80, 112, 192, 320), 1280),
        224,
        "161305613/EN-B0_dds_8gpu.pyth",
        24.92,
    ),
    "EfficientNet-B1": ZooModel(
        "effnet",
        _effnet(32, (2, 3, 3, 4, 4, 5, 2), (16, 24, 40, 80, 112, 192, 320), 1280),
        240,
        "161304979/EN-B1_dds_8gpu.pyth",
        24.068,
    ),
    "EfficientNet-B2": ZooModel(
        "effnet",
        _effnet(32, (2, 3, 3, 4, 4, 5, 2), (16, 24, 48, 88, 120, 208, 352), 1408),
        260,
        "161305015/EN-B2_dds_8gpu.pyth",
        23.518,
    ),
    "EfficientNet-B3": ZooModel(
        "effnet",
        _effnet(40, (2, 3, 3, 5, 5, 6, 2), (24, 32, 48, 96, 136, 232, 384), 1536),
        300,
        "161305060/EN-B3_dds_8gpu.pyth",
        22.47,
    ),
    "EfficientNet-B4": ZooModel(
        "effnet",
        _effnet(48, (2, 4, 4, 6, 6, 8, 2), (24, 32, 56, 112, 160, 272, 448), 1792),
        380,
        "161305098/EN-B4_dds_8gpu.pyth",
        21.374,
    ),
    "EfficientNet-B5": ZooModel(
        "effnet",
        _effnet(48, (3, 5, 5, 7, 7, 9, 3), (24, 40, 64, 128, 176, 304, 512), 2048),
        456,
        "161305138/EN-B5_dds_8gpu.pyth",
        21.674,
    ),
}
PREFIXES = {
    "regnetx": "RegNetX-",
    "regnety": "RegNetY-",
    "resnet": "ResNet-",
    "resnext": "ResNeXt-",
    "effnet": "EfficientNet-",
}
