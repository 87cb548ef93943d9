"""Fine-tune a patched model for a longer context: `rope-ext finetune` (options: --help; README, "Fine-tuning").

    python scripts/finetune.py --config examples/finetune/yarn_pose_32k.yaml
    accelerate launch --config_file examples/accelerate/ddp.yaml scripts/finetune.py --config run.yaml
"""

import sys

from rope_ext.cli import main

if __name__ == "__main__":
    sys.exit(main(["finetune", *sys.argv[1:]]))
