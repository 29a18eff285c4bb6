"""`make demo`: two-view training on synthetic identities, on this CPU, start to finish.

1. makes the synthetic two-view dataset of configs/synthetic_pair.py if it is missing
   (tools/make_synthetic.py: train.rec/train.idx + synthetic_val.bin of held-out identities);
2. trains configs/synthetic_pair.py into a fresh run folder output/synthetic_pair-<time>
   (verification on the held-out identities during training);
3. evaluates the saved backbone.pth on the held-out identities again, from the file alone;
4. prints a short summary: accuracy, time, and where the checkpoint, backbone and logs are.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from backbones.trained import load_saved_backbone
from eval.verification import load_bin, test
from tools import make_synthetic
from training.config import load_config

ROOT = Path(__file__).resolve().parent.parent

CONFIG = ROOT / "configs" / "synthetic_pair.py"
# The dataset the config's numbers were tuned on: identities x images, packed two per record.
DATA_ARGS = ["--identities", "300", "--images-per-identity", "8", "--views", "2", "--val-identities", "100",
             "--val-pairs", "400"]
TARGET = 0.95


def ensure_data(folder: Path) -> None:
    """The demo's data in ``folder``, made when missing, with its preparation recorded (also in data an earlier
    demo made without the record), so that the demo's model.json says how its photos were prepared."""
    wanted = ("train.rec", "train.idx", make_synthetic.VAL_NAME)
    if all((folder / name).is_file() for name in wanted):
        print(f"demo: using the synthetic data in {folder}")
    else:
        print(f"demo: making synthetic two-view data in {folder}")
        if make_synthetic.main(["--output", str(folder), *DATA_ARGS, "--overwrite"]) != 0:
            raise SystemExit("demo: could not make the synthetic data (see the error above)")
    make_synthetic.record_preparation(folder)


def main(argv: list[str] | None = None) -> int:
    # No options; the parser answers --help (and refuses anything else) instead of starting a 4-minute demo.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    os.chdir(ROOT)
    cfg = load_config(CONFIG)
    data = Path(cfg.rec)
    ensure_data(data)
    output = f"{cfg.output}-{time.strftime('%Y%m%d-%H%M%S')}"  # a fresh folder: earlier demos stay as they are
    command = [sys.executable, "train.py", str(CONFIG.relative_to(ROOT)), "--set", f"output={output}"]
    print("demo: " + " ".join(command[1:]), flush=True)
    start = time.time()
    if subprocess.run(command).returncode != 0:
        print(f"demo: training failed (see above; its log is {output}/training.log)", file=sys.stderr)
        return 1
    minutes = (time.time() - start) / 60

    backbone, _ = load_saved_backbone(output)
    val = data / make_synthetic.VAL_NAME
    _, _, accuracy, std, _, _ = test(load_bin(str(val)), backbone, batch_size=64)
    verdict = "meets" if accuracy >= TARGET else "is below"
    print(f"""
demo summary
  trained        {cfg.network} {cfg.network_kwargs} on {cfg.num_views}-view records of {data}, {minutes:.1f} minutes
  held-out       {val} (identities never seen in training)
  Accuracy-Flip  {accuracy:.4f} +- {std:.4f} ({verdict} the {TARGET} target), from {output}/backbone.pth alone
  checkpoint     {output}/checkpoint.json (resume: the train.py command above, plus --resume)
  backbone       {output}/backbone.pth    (arcface_torch-compatible state_dict)
  log            {output}/training.log
  TensorBoard    tensorboard --logdir {output}/tensorboard""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
