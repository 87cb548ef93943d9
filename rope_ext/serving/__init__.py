"""Serving what was extended: what each engine (transformers, vLLM, SGLang, llama.cpp) computes from a config,
``export`` for each of them, and ``doctor`` for any config. Floor 3 (applications)."""

#: the engines ``rope-ext export`` writes for
TARGETS = ("transformers", "vllm", "sglang", "llama.cpp")
