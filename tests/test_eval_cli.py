"""The evaluation command lines end to end on a tiny r18: printed values, scores, ROC plot, every IJB
flag, the ways of naming a model (run folder, bare .pth, ONNX file), and their errors.

References: the backbone run directly on the whole set at once, upstream's accuracy/VAL and pooling
loops (from the sibling test files), XNorm as the mean L2 norm of the raw embeddings, TAR by scanning
every threshold, numpy for hand-built ONNX graphs.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from backbones import get_model
from eval import ijb, verification
from eval.gallery import gallery_file
from eval.onnx_model import OnnxBackbone
from references.ijb import upstream_template_features, upstream_template_scores
from references.verification import reference_evaluate
from tests.test_ijb import FACES, PAIRS, write_ijb
from tests.test_pack_tools import assert_stopped_by_ctrl_c, ctrl_c_once_it_says
from tests.test_verification import VERIFY_BIN, VERIFY_NP_BIN
from tools import export_onnx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = {"width_mult": 0.125}
EMBEDDING_SIZE = 64
BARE = ["--network", "r18", "--network-kw", "width_mult=0.125", f"num_features={EMBEDDING_SIZE}"]

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder as train.py leaves it: backbone.pth and model.json."""
    torch.manual_seed(0)
    model = get_model("r18", num_features=EMBEDDING_SIZE, **OPTIONS)
    with torch.no_grad():  # non-trivial BatchNorm statistics, so eval mode matters
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.uniform_(-0.1, 0.1)
            elif name.endswith("running_var"):
                buffer.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("run")
    torch.save(model.state_dict(), folder / "backbone.pth")
    (folder / "model.json").write_text(json.dumps({"network": "r18", "network_kwargs": OPTIONS,
                                                   "embedding_size": EMBEDDING_SIZE, "num_classes": 20}))
    return folder


@pytest.fixture(scope="module")
def bare(run, tmp_path_factory):
    """The same weights as a bare .pth (no model.json beside it), as arcface_torch saves them."""
    path = tmp_path_factory.mktemp("bare") / "r18.pth"
    shutil.copy(run / "backbone.pth", path)
    return path


@pytest.fixture(scope="module")
def onnx_model(run):
    """The run exported by tools.export_onnx (to run/model.onnx)."""
    assert export_onnx.main(["--model", str(run)]) == 0
    return run / "model.onnx"


def reference_embeddings(weights_path, images):
    model = get_model("r18", num_features=EMBEDDING_SIZE, **OPTIONS)
    model.load_state_dict(torch.load(weights_path, weights_only=True))
    model.eval()  # float32: the backbone's head casts to float32 by design
    with torch.no_grad():
        return model(images.float() / 127.5 - 1.0).double().numpy()


def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def brute_force_tar(scores, labels, far):
    best = 0.0
    for threshold in np.r_[np.inf, scores]:
        accepted = scores >= threshold
        if accepted[labels == 0].mean() <= far:
            best = max(best, accepted[labels == 1].mean())
    return best


def printed(pattern, out):
    match = re.search(pattern, out, re.M)
    assert match, f"{pattern!r} not in:\n{out}"
    return [float(group) for group in match.groups()]


def assert_visible_curve(png_path):
    """A real PNG with a coloured line across most of its width: a curve, not just the legend's
    short sample line (axes, text and grid are grey)."""
    image = np.asarray(Image.open(png_path).convert("RGB")).astype(int)
    assert image.shape[0] >= 300 and image.shape[1] >= 400
    coloured = (image.max(axis=2) - image.min(axis=2)) > 80
    assert coloured.any(axis=0).sum() > 0.6 * image.shape[1], f"{png_path} shows no curve"


# --- verification on .bin sets ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def noise_bin(tmp_path_factory):
    """20 pairs of noise images that the random r18 half separates (VAL strictly between 0 and 1):
    genuine = an image and a noisier copy, impostor = two images; alternating, so each fold has both."""
    rng = np.random.default_rng(0)
    bins, issame = [], []
    for index in range(20):
        first = rng.integers(0, 256, (112, 112, 3)).astype(float)
        if index % 2 == 0:
            second = np.clip(first + rng.normal(0, 40 + 120 * rng.random(), first.shape), 0, 255)
        else:
            second = rng.integers(0, 256, (112, 112, 3)).astype(float)
        for pixels in (first, second):
            buffer = io.BytesIO()
            Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="PNG")
            bins.append(buffer.getvalue())
        issame.append(index % 2 == 0)
    path = tmp_path_factory.mktemp("bins") / "noise.bin"
    with open(path, "wb") as f:
        pickle.dump((bins, issame), f, protocol=4)
    return path


def test_verification_cli_prints_upstream_values_and_writes_scores_and_roc(run, noise_bin, capsys):
    assert verification.main(["--model", str(run), "--bins", str(noise_bin), VERIFY_BIN, VERIFY_NP_BIN,
                              "--batch-size", "8"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    for name, path in (("noise", noise_bin), ("verify", VERIFY_BIN)):
        (original, flipped), issame = verification.load_bin(path)
        raw = [reference_embeddings(run / "backbone.pth", view) for view in (original, flipped)]
        fused = unit(raw[0] + raw[1])
        want_scores = np.sum(fused[0::2] * fused[1::2], axis=1)
        _, _, accuracy, val, val_std, far = reference_evaluate(fused, issame)
        xnorm = np.linalg.norm(np.concatenate(raw), axis=1).mean()
        labels = np.asarray(issame, dtype=int)
        assert printed(rf"^\[{name}\]XNorm: (\S+)$", out)[0] == pytest.approx(xnorm, rel=1e-5)
        assert printed(rf"^\[{name}\]Accuracy-Flip: (\S+)\+-(\S+)$", out) == pytest.approx(
            [accuracy.mean(), accuracy.std()], abs=6e-6)
        different = int((labels == 0).sum())
        for target in (1e-3, 1e-4):  # 10 different-person pairs measure no FAR below 0.1: the line says so
            assert printed(rf"^\[{name}\]TAR@FAR={target:g}: (\S+) \(at 0 false accepts: {different} "
                           rf"different-person pairs cannot measure a FAR below {1 / different:.1g}\)$", out)[0] == \
                pytest.approx(brute_force_tar(want_scores, labels, target), abs=6e-6)
        np.testing.assert_allclose(np.load(run / f"backbone_{name}_scores.npy"), want_scores, rtol=1e-4, atol=1e-5)
        if name == "verify":  # verify_np.bin holds the same images as numpy arrays: the same lines
            verify_lines = [line for line in out.splitlines() if line.startswith(("[verify]", "[verify_np]"))]
            assert [line.replace("[verify_np]", "[verify]").replace("verify_np_", "verify_")
                    for line in verify_lines if line.startswith("[verify_np]")] == [
                line for line in verify_lines if line.startswith("[verify]")]
        if name == "noise":  # one pair per fold in the others: upstream's VAL divides by zero there
            accuracy_original = reference_evaluate(unit(raw[0]), issame)[2]
            assert printed(r"^\[noise\]Accuracy: (\S+)\+-(\S+)$", out) == pytest.approx(
                [accuracy_original.mean(), accuracy_original.std()], abs=6e-6)
            assert 0 < val < 1 and 0 < far < 1  # a VAL that tells a threshold walk from a wrong one
            assert printed(r"^\[noise\]Validation rate: (\S+)\+-(\S+) @ FAR=(\S+)$", out) == pytest.approx(
                [val, val_std, far], abs=6e-6)
    assert_visible_curve(run / "backbone_verification_roc.png")
    # Progress goes to stderr, a line per tenth when it is not a terminal.
    assert re.search(r"^\[verify\] embedding flipped images: 100% \(3/3, \d+ s\)$", captured.err, re.M)


def test_a_bare_pth_with_its_network_and_the_weights_alias_give_the_run_folders_results(run, bare, capsys):
    assert verification.main(["--model", str(run), "--bins", VERIFY_BIN]) == 0
    from_run = capsys.readouterr().out
    assert verification.main(["--weights", str(bare), *BARE, "--bins", VERIFY_BIN]) == 0
    from_bare = capsys.readouterr().out
    strip_paths = re.compile(r"^.*(scores|ROC plot|threshold).*$", re.M)  # only the run folder has a model.json
    assert strip_paths.sub("", from_bare) == strip_paths.sub("", from_run)
    np.testing.assert_array_equal(np.load(bare.parent / "r18_verify_scores.npy"),
                                  np.load(run / "backbone_verify_scores.npy"))


def test_the_onnx_export_scores_a_bin_set_as_its_pth_does(run, onnx_model, capsys):
    assert verification.main(["--model", str(run), "--bins", VERIFY_BIN]) == 0
    torch_out = capsys.readouterr().out
    assert verification.main(["--onnx", str(onnx_model), "--bins", VERIFY_BIN]) == 0
    onnx_out = capsys.readouterr().out
    for line in ("XNorm: (\\S+)", "Accuracy-Flip: (\\S+)\\+-(\\S+)", "Validation rate: (\\S+)\\+-"):
        assert printed(line, onnx_out) == pytest.approx(printed(line, torch_out), abs=1e-4)
    np.testing.assert_allclose(np.load(run / "model_verify_scores.npy"), np.load(run / "backbone_verify_scores.npy"),
                               rtol=0, atol=1e-4)
    assert (run / "model_verification_roc.png").is_file()


# --- IJB --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ijb_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ijb") / "IJBC"
    return root, write_ijb(str(root))


def reference_ijb_scores(run, crops, flip=True, detector_score=True, normalize=False):
    """arcface_torch's eval_ijbc.py order: flip-sum, optional normalisation, detector weighting, pooling."""
    faces = torch.from_numpy(np.stack([crops[f[0]] for f in FACES])).permute(0, 3, 1, 2)
    embeddings = reference_embeddings(run / "backbone.pth", faces)
    if flip:
        embeddings = embeddings + reference_embeddings(run / "backbone.pth", faces.flip(3))
    if normalize:
        embeddings = unit(embeddings)
    if detector_score:
        embeddings = embeddings * np.array([f[4] for f in FACES])[:, None]
    return upstream_template_scores(embeddings, np.array([f[1] for f in FACES]), np.array([f[2] for f in FACES]),
                                    [(a, b) for a, b, _ in PAIRS])


def run_ijb(model_args, root, *flags):
    assert ijb.main([*model_args, "--root", str(root), "--target", "IJBC", "--workers", "0", *flags]) == 0


def test_ijb_cli_prints_the_tar_table_and_writes_scores_and_roc(run, ijb_root, capsys):
    root, crops = ijb_root
    run_ijb(["--model", str(run)], root, "--batch-size", "3")
    want = reference_ijb_scores(run, crops)
    np.testing.assert_allclose(np.load(run / "backbone_ijbc_scores.npy"), want, rtol=1e-4, atol=1e-5)
    labels = np.array([label for _, _, label in PAIRS])
    captured = capsys.readouterr()
    row = next(line for line in captured.out.splitlines() if "r18-IJBC" in line)
    cells = [cell.strip() for cell in row.strip("|").split("|")][1:]
    assert cells == [f"{brute_force_tar(want, labels, far) * 100:.2f}" for far in ijb.IJB_FARS]
    assert_visible_curve(run / "backbone_ijbc_roc.png")
    assert "embedding faces: 100% (3/3, " in captured.err


@pytest.mark.parametrize("flags, reference", [
    (["--no-flip"], dict(flip=False)),
    (["--no-detector-score"], dict(detector_score=False)),
    (["--normalize-faces"], dict(normalize=True)),
    (["--no-flip", "--no-detector-score", "--normalize-faces"], dict(flip=False, detector_score=False, normalize=True)),
])
def test_each_ijb_flag_changes_what_it_should(run, ijb_root, flags, reference):
    root, crops = ijb_root
    run_ijb(["--model", str(run)], root, *flags)
    got = np.load(run / "backbone_ijbc_scores.npy")
    np.testing.assert_allclose(got, reference_ijb_scores(run, crops, **reference), rtol=1e-5, atol=1e-6)
    assert np.abs(got - reference_ijb_scores(run, crops)).max() > 1e-4  # not what the defaults give


def test_ijb_batch_size_and_workers_leave_the_scores_as_they_are(run, ijb_root):
    root, _ = ijb_root
    run_ijb(["--model", str(run)], root, "--batch-size", "8")
    one_batch = np.load(run / "backbone_ijbc_scores.npy")
    # --workers is given last, so it overrides run_ijb's --workers 0: two decoding processes.
    run_ijb(["--model", str(run)], root, "--batch-size", "1", "--workers", "2")
    np.testing.assert_allclose(np.load(run / "backbone_ijbc_scores.npy"), one_batch, rtol=1e-5, atol=1e-6)


def test_the_onnx_export_scores_ijb_as_its_pth_does(run, onnx_model, ijb_root):
    root, _ = ijb_root
    run_ijb(["--model", str(run)], root)
    run_ijb(["--onnx", str(onnx_model)], root)
    np.testing.assert_allclose(np.load(run / "model_ijbc_scores.npy"), np.load(run / "backbone_ijbc_scores.npy"),
                               rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def ijb_1n_root(ijb_root, tmp_path_factory):
    """The miniature release with 1:N lists: subject 10 = templates 1 (G1) and 2 (probe), subject 20 =
    templates 5 (G2) and 8 (probe); each probe is mated in one gallery and non-mated in the other."""
    root = tmp_path_factory.mktemp("ijb1n") / "IJBC"
    shutil.copytree(ijb_root[0], root)
    for kind, rows in [("gallery_G1", [(1, 10)]), ("gallery_G2", [(5, 20)]), ("probe_mixed", [(2, 10), (8, 20)])]:
        (root / "meta" / f"ijbc_1N_{kind}.csv").write_text(
            "TEMPLATE_ID,SUBJECT_ID,FILENAME\n" + "".join(f"{t},{s},img/{t}.jpg\n" for t, s in rows))
    return root, ijb_root[1]


def test_ijb_cli_runs_both_protocols_from_one_embedding_pass(run, ijb_1n_root, capsys):
    root, crops = ijb_1n_root
    run_ijb(["--model", str(run)], root, "--protocol", "11", "1n")
    captured = capsys.readouterr()
    assert captured.err.count("embedding faces: 100%") == 1
    assert "4 templates, 6 pairs, 2 probes in galleries G1 (1) and G2 (1)" in captured.out
    np.testing.assert_allclose(np.load(run / "backbone_ijbc_scores.npy"), reference_ijb_scores(run, crops),
                               rtol=1e-4, atol=1e-5)
    # The reference: each probe's cosine to each gallery template, pooled as upstream pools them.
    faces = torch.from_numpy(np.stack([crops[f[0]] for f in FACES])).permute(0, 3, 1, 2)
    embeddings = reference_embeddings(run / "backbone.pth", faces) + \
        reference_embeddings(run / "backbone.pth", faces.flip(3))
    pooled = dict(zip(*upstream_template_features(embeddings * np.array([f[4] for f in FACES])[:, None],
                                                  np.array([f[1] for f in FACES]), np.array([f[2] for f in FACES]))))
    saved = np.load(run / "backbone_ijbc_1n_scores.npz", allow_pickle=False)
    assert saved["probe_templates"].tolist() == [2, 8] and saved["G2_subjects"].tolist() == [20]
    rows = {}
    for name, gallery, mated, other in [("G1", 1, 2, 8), ("G2", 5, 8, 2)]:
        want = [[pooled[2] @ pooled[gallery]], [pooled[8] @ pooled[gallery]]]
        np.testing.assert_allclose(saved[f"{name}_similarity"], want, rtol=1e-4, atol=1e-5)
        # One mated and one non-mated probe: the mate is at rank 1; identified when above the other's score.
        rows[name] = float(pooled[mated] @ pooled[gallery] > pooled[other] @ pooled[gallery])
    table = {line.split("|")[1].strip(): [cell.strip() for cell in line.strip("|").split("|")][1:]
             for line in captured.out.splitlines() if "r18-IJBC G" in line or "r18-IJBC mean" in line}
    for name, tpir in [*rows.items(), ("mean", (rows["G1"] + rows["G2"]) / 2)]:
        assert table[f"r18-IJBC {name}"] == [f"{tpir * 100:.2f}"] * 2 + ["100.00"] * 3
    assert_visible_curve(run / "backbone_ijbc_1n_det.png")


def test_ijb_1n_alone_needs_no_pair_list_and_a_missing_list_is_one_sentence(run, ijb_1n_root, tmp_path, capsys):
    root, _ = ijb_1n_root
    shutil.copytree(root, tmp_path / "IJBC")
    os.remove(tmp_path / "IJBC" / "meta" / "ijbc_template_pair_label.txt")
    run_ijb(["--model", str(run)], tmp_path / "IJBC", "--protocol", "1n")
    assert "r18-IJBC mean" in capsys.readouterr().out
    os.remove(tmp_path / "IJBC" / "meta" / "ijbc_1N_probe_mixed.csv")
    with pytest.raises(SystemExit):
        run_ijb(["--model", str(run)], tmp_path / "IJBC", "--protocol", "1n")
    assert "ijbc_1N_probe_mixed.csv does not exist" in assert_one_sentence(capsys.readouterr().err)


# --- ONNX models as insightface releases them --------------------------------------------------------


def linear_onnx(path, weight, batch, first_nodes=()):
    """data (batch, 3, 112, 112) -> [first_nodes] -> flatten -> @ weight; ``first_nodes`` are
    (op, name, constant) applied to the input in turn, as an mxnet-converted model starts."""
    nodes, initializers, current = [], [numpy_helper.from_array(weight.astype(np.float32), "w")], "data"
    for index, (op, name, constant) in enumerate(first_nodes):
        initializers.append(numpy_helper.from_array(np.array(constant, np.float32), f"c{index}"))
        nodes.append(helper.make_node(op, [current, f"c{index}"], [f"t{index}"], name=name))
        current = f"t{index}"
    nodes += [helper.make_node("Flatten", [current], ["flat"], name="flatten0"),
              helper.make_node("MatMul", ["flat", "w"], ["fc1"], name="fc1")]
    graph = helper.make_graph(nodes, "face", [helper.make_tensor_value_info("data", TensorProto.FLOAT,
                                                                            [batch, 3, 112, 112])],
                              [helper.make_tensor_value_info("fc1", TensorProto.FLOAT, [batch, weight.shape[1]])],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_onnx_models_taking_raw_pixels_or_a_fixed_batch_get_what_they_expect(tmp_path):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3 * 112 * 112, 4)) / 100
    pixels = torch.from_numpy(rng.integers(0, 256, (7, 3, 112, 112), dtype=np.uint8))
    unit_input = pixels.double().numpy().reshape(7, -1) / 127.5 - 1.0

    # insightface's mxnet-converted models subtract the mean and scale inside: they take 0..255 pixels.
    mxnet_style = OnnxBackbone(linear_onnx(tmp_path / "mx.onnx", weight, "N", [
        ("Sub", "_minusscalar0", 127.5), ("Mul", "_mulscalar0", 1 / 127.5)]))
    assert mxnet_style.raw_pixels
    got = mxnet_style(pixels.float() / 127.5 - 1.0).numpy()
    np.testing.assert_allclose(got, unit_input @ weight, rtol=1e-4, atol=1e-4)

    # A model exported with batch 4 is fed 4 at a time, the last batch padded.
    fixed = OnnxBackbone(linear_onnx(tmp_path / "fixed.onnx", weight, 4))
    assert not fixed.raw_pixels and fixed.fixed_batch == 4
    np.testing.assert_allclose(fixed(pixels.float() / 127.5 - 1.0).numpy(), unit_input @ weight,
                               rtol=1e-4, atol=1e-4)


# --- errors -----------------------------------------------------------------------------------------


def assert_one_sentence(err):
    """``error: <what is wrong>; <how to fix it>`` on one line: lower-case start, no final period."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    message = lines[0][len("error: "):]
    assert "; " in message and not message[0].isupper() and not message.endswith("."), message
    return message


def test_a_missing_weights_file_exits_with_one_sentence_and_no_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "eval.verification", "--model", str(tmp_path / "nope.pth"),
                             "--bins", VERIFY_BIN], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert re.fullmatch(r"error: weights file .*nope\.pth does not exist; .*\n", result.stderr)


def bad_onnx(tmp_path):
    (tmp_path / "broken.onnx").write_bytes(b"not a graph")
    return ["--onnx", str(tmp_path / "broken.onnx")]


@pytest.mark.parametrize("argv, message", [
    (lambda run, bare, tmp: ["--model", str(bare), "--network", "r34", "--network-kw", "width_mult=0.125",
                             f"num_features={EMBEDDING_SIZE}"], "fits network r18, width_mult=0.125, num_features=64"),
    (lambda run, bare, tmp: ["--model", str(bare), "--network", "r18", "--network-kw", "width_mult"],
     "--network-kw 'width_mult' is not KEY=VALUE"),
    (lambda run, bare, tmp: ["--model", str(bare), *BARE, "colour=1"], "unknown option.*colour"),
    (lambda run, bare, tmp: ["--model", str(bare)],
     r"bare backbone .*--network NAME.*it fits network r18, width_mult=0.125, num_features=64"),
    (lambda run, bare, tmp: ["--model", str(run), "--network", "r34"], "--network r34 contradicts .*model.json"),
    (lambda run, bare, tmp: ["--model", str(run), "--network-kw", "width_mult=0.25"],
     "--network-kw width_mult=0.25 contradicts .*width_mult=0.125"),
    (lambda run, bare, tmp: ["--model", str(tmp)], "holds no backbone.pth"),
    (lambda run, bare, tmp: ["--onnx", str(run / "backbone.pth"), "--network", "r18"], "drop them"),
    (lambda run, bare, tmp: bad_onnx(tmp), "broken.onnx is not a readable ONNX model"),
    (lambda run, bare, tmp: ["--model", str(run), "--batch-size", "0"], "--batch-size 0 is not a positive number"),
])
def test_bad_model_arguments_exit_with_one_sentence(run, bare, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        verification.main([*argv(run, bare, tmp_path), "--bins", VERIFY_BIN])
    assert exit_info.value.code == 1
    assert re.search(message, assert_one_sentence(capsys.readouterr().err))


def test_bad_data_exits_with_one_sentence(run, tmp_path, capsys):
    with pytest.raises(SystemExit):
        verification.main(["--model", str(run), "--bins", str(tmp_path / "lfw.bin")])
    assert "lfw.bin does not exist" in assert_one_sentence(capsys.readouterr().err)
    os.makedirs(tmp_path / "copy")
    shutil.copy(VERIFY_BIN, tmp_path / "copy" / "verify.bin")
    with pytest.raises(SystemExit):
        verification.main(["--model", str(run), "--bins", VERIFY_BIN, str(tmp_path / "copy" / "verify.bin")])
    assert "two sets named verify" in assert_one_sentence(capsys.readouterr().err)
    with pytest.raises(SystemExit):
        ijb.main(["--model", str(run), "--root", str(tmp_path), "--target", "IJBB"])
    assert "ijbb_name_5pts_score.txt does not exist" in assert_one_sentence(capsys.readouterr().err)
    with pytest.raises(SystemExit):
        ijb.main(["--model", str(run), "--root", str(tmp_path), "--workers", "-1"])
    assert "--workers -1 is negative" in assert_one_sentence(capsys.readouterr().err)


def test_an_unwritable_model_folder_is_refused_before_any_work(onnx_model, monkeypatch, capsys):
    # Tests may run as root, who can write anywhere: the folder is made read-only in os.access's eyes.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: mode != os.W_OK and real_access(path, mode))
    with pytest.raises(SystemExit):
        verification.main(["--onnx", str(onnx_model), "--bins", VERIFY_BIN])
    captured = capsys.readouterr()
    assert "is not writable; copy the model" in assert_one_sentence(captured.err)
    assert "embedding" not in captured.err  # refused before the work, not after


def test_an_undecodable_ijb_image_is_one_sentence_even_from_a_worker(run, tmp_path, capsys):
    write_ijb(str(tmp_path / "IJBC"))
    (tmp_path / "IJBC" / "loose_crop" / "5.jpg").write_bytes(b"\xff\xd8 truncated")
    with pytest.raises(SystemExit):
        ijb.main(["--model", str(run), "--root", str(tmp_path / "IJBC"), "--workers", "1"])
    assert re.search(r"face image .*5\.jpg cannot be decoded", assert_one_sentence(capsys.readouterr().err))


def test_evaluation_compares_the_sets_preparation_with_the_models_and_keeps_other_sets_thresholds(run, noise_bin,
                                                                                                   tmp_path, capsys):
    folder = Path(shutil.copytree(run, tmp_path / "run"))
    info = json.loads((folder / "model.json").read_text())
    earlier = {"threshold": 0.3, "far": 0.01, "accuracy": 0.9, "pairs": 300, "by": "eval.verification"}
    (folder / "model.json").write_text(json.dumps({**info, "photo_preparation": "crop",
                                                   "verification": {"faces_val": earlier}}))
    held_out = shutil.copy(noise_bin, tmp_path / "noise.bin")
    # What tools.make_bin leaves beside a set of --pad photos, none of whose people trained the model.
    (tmp_path / "noise.bin.preparation.json").write_text('{"photo_preparation": "pad", "people_in_training": 0}')
    assert verification.main(["--model", str(folder), "--bins", str(held_out), "--batch-size", "8"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning")]
    assert warnings == [f"warning: {held_out} holds photos prepared with --pad, but {folder / 'model.json'} records "
                        "--crop for the model's training photos, and on these photos the two give different faces, so "
                        "its scores understate the model; make it again with tools.make_bin --crop"]
    # A threshold from photos prepared unlike the training photos would misjudge pairs: none is recorded.
    assert ("threshold: none recorded for noise: its photos were prepared unlike the training photos (the warning "
            "above), so its threshold would misjudge pairs") in captured.out.splitlines()
    assert json.loads((folder / "model.json").read_text())["verification"] == {"faces_val": earlier}
    (tmp_path / "noise.bin.preparation.json").write_text('{"photo_preparation": "crop", "people_in_training": 0}')
    assert verification.main(["--model", str(folder), "--bins", str(held_out), "--batch-size", "8"]) == 0
    recorded = json.loads((folder / "model.json").read_text())["verification"]
    assert recorded["faces_val"] == earlier and recorded["noise"]["held_out"] is True
    assert recorded["noise"]["different"] == 10  # the FAR's denominator: the set's different-person pairs
    capsys.readouterr()
    assert verification.main(["--model", str(folder), "--forget", "noise"]) == 0
    assert capsys.readouterr().out == f"forgot the threshold of noise in {folder / 'model.json'}\n"
    assert json.loads((folder / "model.json").read_text())["verification"] == {"faces_val": earlier}
    with pytest.raises(SystemExit):
        verification.main(["--model", str(folder), "--forget", "lfw"])
    assert assert_one_sentence(capsys.readouterr().err) == (
        f"--forget lfw: {folder / 'model.json'} records no set of that name (recorded: faces_val); pass one of those")


def test_a_missing_bin_names_the_option_it_came_from(run, tmp_path, capsys):
    with pytest.raises(SystemExit):
        verification.main(["--model", str(run), "--bins", str(tmp_path / "nope.bin")])
    assert assert_one_sentence(capsys.readouterr().err) == (
        f"verification set {tmp_path / 'nope.bin'} does not exist; check the path given to --bins")


def test_ctrl_c_stops_verification_and_search_in_one_line(run, tmp_path):
    """A real SIGINT to the command's process group, as a terminal sends it, while it embeds: 100 pairs and 100
    gallery photos, one image a batch, so that the command is far from done when its first tenth is said."""
    rng = np.random.default_rng(0)
    faces = [rng.integers(0, 256, (112, 112, 3), dtype=np.uint8) for _ in range(40)]
    encoded = []
    for face in faces:
        buffer = io.BytesIO()
        Image.fromarray(face).save(buffer, format="PNG", compress_level=0)
        encoded.append(buffer.getvalue())
    big = tmp_path / "big.bin"
    big.write_bytes(pickle.dumps(([encoded[i % 40] for i in range(200)], [i % 2 == 0 for i in range(100)]),
                                 protocol=4))
    status, output = ctrl_c_once_it_says(["-m", "eval.verification", "--model", str(run), "--bins", str(big),
                                          "--batch-size", "1"], tmp_path / "verification.out",
                                         "[big] embedding original images: 10%")
    assert_stopped_by_ctrl_c(status, output)
    assert not list(run.glob("*big*"))  # no scores, no plot
    gallery = tmp_path / "gallery"
    for index in range(100):
        (gallery / f"p{index // 10:02d}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(faces[index % 40]).save(gallery / f"p{index // 10:02d}" / f"{index}.png", compress_level=0)
    status, output = ctrl_c_once_it_says(["-m", "tools.search", "--model", str(run), "--gallery", str(gallery),
                                          str(gallery / "p00" / "0.png"), "--batch-size", "1"],
                                         tmp_path / "search.out", "embedding gallery photos: 10%")
    assert_stopped_by_ctrl_c(status, output)
    assert not gallery_file(gallery).exists()
