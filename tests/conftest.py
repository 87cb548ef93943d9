import os
import random
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Two small plain-text documents of random words (one.txt: 4,000 words; two.txt: 600), for training runs."""
    folder = tmp_path_factory.mktemp("texts")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "the", "and", "of", "light", "water", "stone", "river", "hill"]
    for name, count in (("one.txt", 4000), ("two.txt", 600)):
        (folder / name).write_text(" ".join(rng.choice(words) for _ in range(count)))
    return folder
