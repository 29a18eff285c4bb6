"""The evaluation command lines end to end on a tiny r18: printed lines, scores, ROC plot, errors.

References: the backbone run directly on the whole set at once, upstream's accuracy/pooling loops (from the
sibling test files), TAR by scanning every threshold.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from backbones import get_model
from eval import ijb, verification
from tests.test_ijb import FACES, PAIRS, upstream_template_scores, write_ijb
from tests.test_verification import VERIFY_BIN, VERIFY_NP_BIN, reference_evaluate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETWORK = ["--network", "r18", "--network-kw", "width_mult=0.125"]

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    torch.manual_seed(0)
    model = get_model("r18", width_mult=0.125)
    with torch.no_grad():  # non-trivial BatchNorm statistics, so eval mode matters
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.uniform_(-0.1, 0.1)
            elif name.endswith("running_var"):
                buffer.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("run") / "backbone.pth"
    torch.save(model.state_dict(), path)
    return str(path)


def reference_embeddings(weights_path, images):
    model = get_model("r18", width_mult=0.125)
    model.load_state_dict(torch.load(weights_path, weights_only=True))
    model.eval()  # float32: the backbone's head casts to float32 by design
    with torch.no_grad():
        return model(images.float() / 127.5 - 1.0).double().numpy()


def brute_force_tar(scores, labels, far):
    best = 0.0
    for threshold in np.r_[np.inf, scores]:
        accepted = scores >= threshold
        if accepted[labels == 0].mean() <= far:
            best = max(best, accepted[labels == 1].mean())
    return best


def run_cli(module, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def assert_visible_curve(png_path):
    """A real PNG with a coloured line across most of its width: a curve, not just the legend's
    short sample line (axes, text and grid are grey)."""
    image = np.asarray(Image.open(png_path).convert("RGB")).astype(int)
    assert image.shape[0] >= 300 and image.shape[1] >= 400
    coloured = (image.max(axis=2) - image.min(axis=2)) > 80
    assert coloured.any(axis=0).sum() > 0.6 * image.shape[1], f"{png_path} shows no curve"


def test_verification_cli_prints_upstream_lines_and_writes_scores_and_roc(weights):
    result = run_cli("eval.verification", *NETWORK, "--weights", weights, "--bins", VERIFY_BIN, VERIFY_NP_BIN,
                     "--batch-size", "8")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    prefix = os.path.splitext(weights)[0]

    (original, flipped), issame = verification.load_bin(VERIFY_BIN)
    fused = reference_embeddings(weights, original) + reference_embeddings(weights, flipped)
    fused /= np.linalg.norm(fused, axis=1, keepdims=True)
    want_scores = np.sum(fused[0::2] * fused[1::2], axis=1)
    accuracy = reference_evaluate(fused, issame, 10)[2]
    labels = np.asarray(issame, dtype=int)
    for name in ("verify", "verify_np"):
        assert re.search(rf"^\[{name}\]XNorm: \d+\.\d{{6}}$", out, re.M), out
        assert re.search(rf"^\[{name}\]Accuracy: \d\.\d{{5}}\+-\d\.\d{{5}}$", out, re.M), out
        assert f"[{name}]Accuracy-Flip: {accuracy.mean():1.5f}+-{accuracy.std():1.5f}" in out
        for far in (1e-3, 1e-4):
            assert f"[{name}]TAR@FAR={far:g}: {brute_force_tar(want_scores, labels, far):1.5f}" in out
        scores = np.load(f"{prefix}_{name}_scores.npy")
        np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-5)
    assert_visible_curve(f"{prefix}_verification_roc.png")


def test_ijb_cli_prints_the_tar_table_and_writes_scores_and_roc(weights, tmp_path):
    crops = write_ijb(str(tmp_path / "IJBC"))
    result = run_cli("eval.ijb", *NETWORK, "--weights", weights, "--root", str(tmp_path / "IJBC"),
                     "--target", "IJBC", "--batch-size", "3", "--workers", "1")
    assert result.returncode == 0, result.stderr

    faces = torch.from_numpy(np.stack([crops[f[0]] for f in FACES])).permute(0, 3, 1, 2)
    embeddings = reference_embeddings(weights, faces) + reference_embeddings(weights, faces.flip(3))
    embeddings *= np.array([f[4] for f in FACES])[:, None]
    want = upstream_template_scores(embeddings, np.array([f[1] for f in FACES]), np.array([f[2] for f in FACES]),
                                    [(a, b) for a, b, _ in PAIRS])
    prefix = os.path.splitext(weights)[0]
    np.testing.assert_allclose(np.load(f"{prefix}_ijbc_scores.npy"), want, rtol=1e-4, atol=1e-5)
    labels = np.array([label for _, _, label in PAIRS])
    row = next(line for line in result.stdout.splitlines() if "r18-IJBC" in line)
    printed = [cell.strip() for cell in row.strip("|").split("|")][1:]
    assert printed == [f"{brute_force_tar(want, labels, far) * 100:.2f}" for far in ijb.IJB_FARS]
    assert_visible_curve(f"{prefix}_ijbc_roc.png")


def test_a_missing_weights_file_exits_with_one_sentence(tmp_path):
    result = run_cli("eval.verification", *NETWORK, "--weights", str(tmp_path / "nope.pth"), "--bins", VERIFY_BIN)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert re.fullmatch(r"error: weights file .*nope\.pth does not exist.*\n", result.stderr)


@pytest.mark.parametrize("argv, message", [
    (["--network", "r34", "--network-kw", "width_mult=0.125"], "fits network r18"),
    (["--network", "r18", "--network-kw", "width_mult"], "--network-kw 'width_mult' is not KEY=VALUE"),
    (["--network", "r18", "--network-kw", "colour=1"], "--network-kw: .*unknown option"),
])
def test_bad_model_arguments_exit_with_one_sentence(weights, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        verification.main([*argv, "--weights", weights, "--bins", VERIFY_BIN])
    assert exit_info.value.code == 1
    assert re.search(message, capsys.readouterr().err)


def test_bad_data_exits_with_one_sentence(weights, tmp_path, capsys):
    with pytest.raises(SystemExit):
        verification.main([*NETWORK, "--weights", weights, "--bins", str(tmp_path / "lfw.bin")])
    assert "lfw.bin does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ijb.main([*NETWORK, "--weights", weights, "--root", str(tmp_path), "--target", "IJBB"])
    assert "ijbb_name_5pts_score.txt does not exist" in capsys.readouterr().err
