"""Pure-math method definitions (no transformers import): configs, formulas and the method registry."""

from rope_ext.methods.absolute import AbsHierarchicalConfig, AbsInterpConfig, AbsoluteConfig, SinusoidalConfig
from rope_ext.methods.base import (
    HOOK_ABSOLUTE,
    HOOK_ATTENTION,
    HOOK_BIAS,
    HOOK_BUCKET,
    HOOK_DISTANCE,
    HOOK_FREQUENCY,
    HOOK_LOG_BUCKET,
    HOOK_PAIR_SCALE,
    HOOK_QUERY_SCALE,
    HOOK_WRAPPER,
    MethodConfig,
    get_method_class,
    list_methods,
    make_config,
    make_configs,
    methods_with_hooks,
    register_method,
    undocumented,
    unregister_method,
)
from rope_ext.methods.biases import (
    AlibiConfig,
    BiasConfig,
    FireConfig,
    KerpleConfig,
    KeyOnlyBias,
    SandwichConfig,
    alibi_slopes,
)
from rope_ext.methods.buckets import (
    BucketConfig,
    DebertaBucketScaleConfig,
    DebertaBucketStretchConfig,
    LogBucketConfig,
    T5BucketExtendConfig,
    T5BucketScaleConfig,
    deberta_log_bucket,
    t5_bucket,
)
from rope_ext.methods.distances import DistanceConfig, XlnetClampConfig, XlnetInterpConfig
from rope_ext.methods.dual_chunk import DualChunkConfig
from rope_ext.methods.frequency import DynamicFrequencyConfig, FrequencyConfig, RotarySpec
from rope_ext.methods.interpolation import DynamicNTKConfig, NTKConfig, PIConfig
from rope_ext.methods.llama3 import Llama3Config
from rope_ext.methods.longrope import LongRopeConfig
from rope_ext.methods.options import MAX_FACTOR, Check, option
from rope_ext.methods.position_rules import AttentionConfig, Region, WindowConfig, WindowRule
from rope_ext.methods.query_scales import LogNConfig
from rope_ext.methods.window_rules import LeakyReRopeConfig, ReRopeConfig, SelfExtendConfig, StringConfig
from rope_ext.methods.wrappers import S2AttnConfig, s2_group_size
from rope_ext.methods.xpos import XposConfig, xpos_zeta
from rope_ext.methods.yarn import ByPartsConfig, DynamicYarnConfig, NTKByPartsConfig, YarnConfig

__all__ = [
    "HOOK_BUCKET",
    "HOOK_LOG_BUCKET",
    "HOOK_DISTANCE",
    "DistanceConfig",
    "XlnetClampConfig",
    "XlnetInterpConfig",
    "DebertaBucketScaleConfig",
    "DebertaBucketStretchConfig",
    "LogBucketConfig",
    "deberta_log_bucket",
    "BucketConfig",
    "T5BucketExtendConfig",
    "T5BucketScaleConfig",
    "t5_bucket",
    "HOOK_PAIR_SCALE",
    "XposConfig",
    "xpos_zeta",
    "HOOK_ABSOLUTE",
    "HOOK_BIAS",
    "AbsHierarchicalConfig",
    "AbsInterpConfig",
    "AbsoluteConfig",
    "AlibiConfig",
    "BiasConfig",
    "FireConfig",
    "KerpleConfig",
    "SandwichConfig",
    "SinusoidalConfig",
    "alibi_slopes",
    "HOOK_ATTENTION",
    "HOOK_QUERY_SCALE",
    "HOOK_WRAPPER",
    "AttentionConfig",
    "DualChunkConfig",
    "LeakyReRopeConfig",
    "LogNConfig",
    "ReRopeConfig",
    "S2AttnConfig",
    "SelfExtendConfig",
    "StringConfig",
    "WindowConfig",
    "WindowRule",
    "Region",
    "KeyOnlyBias",
    "ByPartsConfig",
    "DynamicFrequencyConfig",
    "Check",
    "MAX_FACTOR",
    "option",
    "HOOK_FREQUENCY",
    "DynamicNTKConfig",
    "DynamicYarnConfig",
    "FrequencyConfig",
    "Llama3Config",
    "LongRopeConfig",
    "MethodConfig",
    "NTKByPartsConfig",
    "NTKConfig",
    "PIConfig",
    "RotarySpec",
    "YarnConfig",
    "get_method_class",
    "list_methods",
    "make_config",
    "make_configs",
    "methods_with_hooks",
    "register_method",
    "s2_group_size",
    "undocumented",
    "unregister_method",
]
