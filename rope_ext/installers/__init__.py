"""Hook installers, one per hook kind, and the modules that stand in for a model's own position modules."""

from rope_ext.installers.base import (
    HookInstaller,
    PlanBuilder,
    RopeExtModule,
    Site,
    Sites,
    get_hook,
    register_hook,
    unregister_hook,
)
from rope_ext.installers.attention import (  # (registers the attention function with transformers)
    ATTENTION_KEY,
    AttentionLayer,
    AttentionSite,
    ProgramSetup,
    installed_programs,
    program_setup,
)
from rope_ext.installers.rotary import RopeExtRotaryEmbedding, RotarySite
from rope_ext.installers.rotation import rotate_in_attention
from rope_ext.installers.frequency import FrequencyInstaller
from rope_ext.installers.positions import PositionRuleInstaller, QueryScaleInstaller
from rope_ext.installers.wrapper import WrapperInstaller
from rope_ext.installers.absolute import AbsoluteInstaller, AbsoluteSite, PositionTable
from rope_ext.installers.bias import BiasInstaller, PositionBias
from rope_ext.installers.buckets import BucketInstaller, BucketSite, LogBucketInstaller, LogBucketSite
from rope_ext.installers.distances import DistanceInstaller, DistanceSite
from rope_ext.installers.pair_scale import PairScaleInstaller
from rope_ext.installers.params import PARAMS_ATTR, OwnedModule, PatchParameters, own

__all__ = [
    "AbsoluteInstaller",
    "AbsoluteSite",
    "BiasInstaller",
    "BucketInstaller",
    "BucketSite",
    "DistanceInstaller",
    "DistanceSite",
    "LogBucketInstaller",
    "LogBucketSite",
    "PositionBias",
    "PositionTable",
    "ATTENTION_KEY",
    "AttentionLayer",
    "AttentionSite",
    "FrequencyInstaller",
    "HookInstaller",
    "OwnedModule",
    "PairScaleInstaller",
    "PARAMS_ATTR",
    "PatchParameters",
    "PlanBuilder",
    "PositionRuleInstaller",
    "ProgramSetup",
    "QueryScaleInstaller",
    "RopeExtModule",
    "RopeExtRotaryEmbedding",
    "RotarySite",
    "Site",
    "Sites",
    "WrapperInstaller",
    "get_hook",
    "installed_programs",
    "own",
    "program_setup",
    "register_hook",
    "rotate_in_attention",
    "unregister_hook",
]
