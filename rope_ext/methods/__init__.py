"""Pure-math method definitions (no transformers import): configs, formulas and the method registry."""

from rope_ext.methods.base import (
    HOOK_FREQUENCY,
    MethodConfig,
    get_method_class,
    list_methods,
    make_config,
    make_configs,
    register_method,
    unregister_method,
)
from rope_ext.methods.frequency import (
    DynamicNTKConfig,
    DynamicYarnConfig,
    FrequencyConfig,
    Llama3Config,
    LongRopeConfig,
    NTKByPartsConfig,
    NTKConfig,
    PIConfig,
    RotarySpec,
    YarnConfig,
)

__all__ = [
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
    "register_method",
    "unregister_method",
]
