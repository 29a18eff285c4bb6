"""Weights loading (a run folder or a .pth), ONNX export (checked by onnxruntime) and the single-image
inference CLI.

References: onnxruntime running the exported graph, PIL decoding the images the test wrote, and
embeddings computed in the test from a model loaded with plain ``load_state_dict``.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from backbones import WeightsError, get_model, load_backbone, read_face_image
from backbones.trained import SavedBackbone, find_saved_backbone, load_saved_backbone
from dataset import Preparation
from tools import export_onnx, inference
from utils.errors import ConfigError, FaceImageError

ROOT = Path(__file__).resolve().parent.parent
R18 = ["--network", "r18", "--network-kw", "width_mult=0.25"]
torch.set_num_threads(1)


def trained_like(name: str, width_mult: float, seed: int = 0) -> nn.Module:
    """A network whose BN statistics and affine terms look trained, so outputs are O(1)."""
    torch.manual_seed(seed)
    model = get_model(name, width_mult=width_mult)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.momentum = None
                if module.weight.requires_grad:
                    module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.1)
        model.train()
        for _ in range(2):
            model(torch.rand(8, 3, 112, 112) * 2 - 1)
    return model.eval()


@pytest.fixture(scope="module")
def r18_weights(tmp_path_factory) -> tuple[Path, nn.Module]:
    model = trained_like("r18", 0.25)
    path = tmp_path_factory.mktemp("weights") / "backbone.pth"
    torch.save(model.state_dict(), path)
    return path, model


@pytest.fixture(scope="module")
def r18_run(r18_weights, tmp_path_factory) -> Path:
    """The same weights in a run folder as train.py writes it (backbone.pth + model.json)."""
    folder = tmp_path_factory.mktemp("run")
    (folder / "backbone.pth").write_bytes(r18_weights[0].read_bytes())
    (folder / "model.json").write_text(json.dumps({"network": "r18", "network_kwargs": {"width_mult": 0.25},
                                                   "embedding_size": 512, "num_classes": 10}))
    return folder


def write_face(path: Path, size: tuple[int, int], seed: int, mode: str = "RGB") -> Path:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    Image.fromarray(pixels.squeeze(-1) if mode == "L" else pixels, mode).save(path)
    return path


# --- loading weights ----------------------------------------------------------------------------


def test_load_backbone_restores_the_saved_network_exactly(r18_weights):
    path, model = r18_weights
    loaded = load_backbone("r18", path, width_mult=0.25)
    assert not loaded.training
    x = torch.rand(2, 3, 112, 112) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_load_backbone_accepts_ddp_prefixes_and_training_checkpoints(r18_weights, tmp_path):
    path, model = r18_weights
    state = torch.load(path, weights_only=True)
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "ddp.pth")
    torch.save({"state_dict_backbone": state, "global_step": 10}, tmp_path / "checkpoint_gpu_0.pt")
    for name in ("ddp.pth", "checkpoint_gpu_0.pt"):
        loaded = load_backbone("r18", tmp_path / name, width_mult=0.25)
        reloaded = loaded.state_dict()
        assert all(torch.equal(reloaded[k], v) for k, v in state.items())


def test_missing_weights_file_is_named(tmp_path):
    with pytest.raises(WeightsError, match="nothing.pth"):
        load_backbone("r18", tmp_path / "nothing.pth")


def test_a_file_that_is_not_weights_is_refused(tmp_path):
    (tmp_path / "notes.pth").write_text("not a checkpoint")
    with pytest.raises(WeightsError, match="not a readable PyTorch weights file"):
        load_backbone("r18", tmp_path / "notes.pth")
    torch.save({"lr": 0.1}, tmp_path / "config.pth")
    with pytest.raises(WeightsError, match="not a backbone state_dict"):
        load_backbone("r18", tmp_path / "config.pth")


def test_weights_of_another_width_name_the_mismatch_and_the_right_width(r18_weights):
    path, _ = r18_weights
    with pytest.raises(WeightsError) as error:
        load_backbone("r18", path)
    message = str(error.value)
    assert "conv1.weight [16, 3, 3, 3] in the file vs [64, 3, 3, 3] in the network" in message
    assert "fits network r18, width_mult=0.25, num_features=512" in message


def test_a_run_folder_or_a_pth_beside_model_json_names_its_network(r18_weights, r18_run):
    path, model = r18_weights
    want = SavedBackbone(r18_run / "backbone.pth", "r18", {"width_mult": 0.25, "num_features": 512})
    assert find_saved_backbone(r18_run) == find_saved_backbone(r18_run / "backbone.pth") == want
    # Options the run folder already states may be repeated; the network may be named again.
    assert find_saved_backbone(r18_run, "r18", {"width_mult": 0.25}) == want
    loaded, described = load_saved_backbone(r18_run)
    assert described == want and not loaded.training
    assert described.describe() == f"r18 (width_mult=0.25, num_features=512) from {r18_run / 'backbone.pth'}"
    reloaded = loaded.state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in model.state_dict().items())
    assert find_saved_backbone(path, "r18", {"width_mult": 0.25}) == SavedBackbone(path, "r18", {"width_mult": 0.25})


def test_a_model_path_that_names_no_model_is_one_sentence(r18_weights, r18_run, tmp_path):
    path, _ = r18_weights
    with pytest.raises(ConfigError, match=r"bare backbone without a model.json .*it fits network r18, width_mult=0.25"):
        find_saved_backbone(path)
    with pytest.raises(WeightsError, match="holds no backbone.pth; pass a run folder"):
        find_saved_backbone(tmp_path)
    with pytest.raises(WeightsError, match="absent does not exist"):
        find_saved_backbone(tmp_path / "absent")
    with pytest.raises(ConfigError, match="--network r50 contradicts .*model.json, which says r18"):
        find_saved_backbone(r18_run, "r50")
    (tmp_path / "backbone.pth").write_bytes(path.read_bytes())
    (tmp_path / "model.json").write_text("{not json")
    with pytest.raises(WeightsError, match="model.json cannot be read as JSON"):
        find_saved_backbone(tmp_path)
    (tmp_path / "model.json").write_text('{"lr": 0.1}')
    with pytest.raises(WeightsError, match="model.json does not name a network"):
        find_saved_backbone(tmp_path)


def test_weights_of_another_network_name_the_network_they_fit(r18_weights, tmp_path):
    path, _ = r18_weights
    with pytest.raises(WeightsError, match=r"missing keys \(layer1\.2\..*fits network r18, width_mult=0.25"):
        load_backbone("r50", path, width_mult=0.25)
    torch.save(get_model("mbf", num_features=128).state_dict(), tmp_path / "mbf.pth")
    with pytest.raises(WeightsError, match="fits network mbf, width_mult=1, num_features=128"):
        load_backbone("r18", tmp_path / "mbf.pth")


# --- ONNX export ----------------------------------------------------------------------------


def check_onnx_against_pytorch(path: Path, model: nn.Module) -> None:
    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == ["data"]
    batch_dim = graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.HasField("dim_value")  # symbolic: any batch size
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        x = torch.rand(batch, 3, 112, 112, generator=torch.Generator().manual_seed(batch)) * 2 - 1
        exported = session.run(None, {"data": x.numpy()})[0]
        with torch.no_grad():
            reference = model(x).numpy()
        assert exported.shape == reference.shape == (batch, 512)
        assert np.abs(reference).max() > 0.1  # a meaningful comparison, not of near-zero outputs
        np.testing.assert_allclose(exported, reference, rtol=0, atol=1e-4)


def test_export_cli_given_a_run_folder_writes_a_checked_model_onnx_into_it(r18_weights, r18_run, capsys):
    _, model = r18_weights
    assert export_onnx.main(["--model", str(r18_run)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {r18_run / 'model.onnx'} from r18 (width_mult=0.25" in out
    assert float(re.search(r"max abs difference (\S+)", out).group(1)) < 1e-4
    check_onnx_against_pytorch(r18_run / "model.onnx", model)


def test_export_of_mbf_matches_pytorch_in_onnxruntime(tmp_path):
    model = trained_like("mbf", 1.0)
    export_onnx.export_onnx(model, tmp_path / "mbf.onnx")
    check_onnx_against_pytorch(tmp_path / "mbf.onnx", model)


def exits_with(capsys, main, argv) -> str:
    """``main(argv)`` ends with status 1 and one ``error: ...`` line; returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_export_cli_refuses_to_overwrite_and_explains_bad_weights(r18_weights, tmp_path, capsys):
    path, _ = r18_weights
    existing = tmp_path / "model.onnx"
    existing.write_bytes(b"keep me")
    err = exits_with(capsys, export_onnx.main, ["--weights", str(path), *R18, "--output", str(existing)])
    assert "already exists; pass --force" in err and existing.read_bytes() == b"keep me"
    err = exits_with(capsys, export_onnx.main, ["--model", str(path), "--network", "r34", "--output",
                                                str(tmp_path / "x.onnx")])
    assert "fits network r18, width_mult=0.25" in err
    err = exits_with(capsys, export_onnx.main, ["--model", str(path), *R18, "--output", str(tmp_path / "no" / "x")])
    assert "is in a folder that does not exist" in err


def test_export_script_reports_a_missing_weights_file_without_a_traceback(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "tools.export_onnx", "--network", "r18", "--model", str(tmp_path / "none.pth")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert run.returncode == 1
    assert run.stderr.startswith("error: ") and "none.pth does not exist" in run.stderr
    assert "Traceback" not in run.stderr


# --- images and the inference CLI -------------------------------------------------------------------


def decoded(path: Path) -> torch.Tensor:
    """PIL's RGB decoding of the file, mapped to [-1, 1] in float64: the reference pixels."""
    pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.float64)
    return torch.from_numpy(pixels / 127.5 - 1.0).permute(2, 0, 1)


@pytest.mark.parametrize("mode, suffix", [("RGB", ".jpg"), ("RGBA", ".png"), ("L", ".png")])
def test_read_face_image_gives_rgb_in_minus_one_to_one(tmp_path, mode, suffix):
    path = write_face(tmp_path / f"face{suffix}", (112, 112), seed=1, mode=mode)
    image = read_face_image(path)
    assert image.shape == (3, 112, 112) and image.dtype == torch.float32
    torch.testing.assert_close(image.double(), decoded(path), rtol=0, atol=1e-6)


def test_read_face_image_resizes_other_square_sizes_silently(tmp_path, caplog):
    path = write_face(tmp_path / "big.png", (224, 224), seed=2)
    with caplog.at_level(logging.WARNING):
        image = read_face_image(path)
    assert image.shape == (3, 112, 112) and not caplog.text
    expected_path = tmp_path / "expected.png"
    Image.open(path).convert("RGB").resize((112, 112), Image.BILINEAR).save(expected_path)
    torch.testing.assert_close(image.double(), decoded(expected_path), rtol=0, atol=1e-6)


def test_read_face_image_stretches_or_crops_a_photo_that_is_not_square(tmp_path, caplog):
    """The default (resize) stretches and warns; crop cuts the centred square: PIL's own crop and resize."""
    path = write_face(tmp_path / "portrait.png", (92, 112), seed=3)
    with caplog.at_level(logging.WARNING):
        stretched = read_face_image(path)
    assert f"1 of 1 photos are not square (e.g. {path}, 92x112): --resize stretched them" in caplog.text
    expected = {"stretched": Image.open(path).convert("RGB").resize((112, 112), Image.BILINEAR),
                "cropped": Image.open(path).convert("RGB").crop((0, 10, 92, 102)).resize((112, 112), Image.BILINEAR)}
    for name, image in expected.items():
        image.save(tmp_path / f"{name}.png")
    torch.testing.assert_close(stretched.double(), decoded(tmp_path / "stretched.png"), rtol=0, atol=1e-6)
    cropped = read_face_image(path, Preparation("crop"))
    torch.testing.assert_close(cropped.double(), decoded(tmp_path / "cropped.png"), rtol=0, atol=1e-6)


def test_read_face_image_refuses_non_images_and_missing_files(tmp_path):
    (tmp_path / "text.jpg").write_text("hello")
    with pytest.raises(FaceImageError, match="cannot read image .*text.jpg"):
        read_face_image(tmp_path / "text.jpg")
    with pytest.raises(FaceImageError, match="missing.jpg does not exist"):
        read_face_image(tmp_path / "missing.jpg")


def reference_embeddings(weights: Path, *paths: Path) -> np.ndarray:
    """Each photo's and its mirror image's embeddings summed and normalised, as verification scores them."""
    model = get_model("r18", width_mult=0.25)
    model.load_state_dict(torch.load(weights, weights_only=True))
    images = torch.stack([decoded(p).float() for p in paths])
    with torch.no_grad():
        return F.normalize(model.eval()(images) + model(images.flip(3)), dim=1).numpy()


def test_inference_cli_saves_one_unit_embedding(r18_weights, tmp_path, capsys):
    path, _ = r18_weights
    face = write_face(tmp_path / "a.jpg", (112, 112), seed=4)
    saved = tmp_path / "a.npy"
    assert inference.main([str(face), "--weights", str(path), *R18, "--save", str(saved)]) == 0
    embedding = np.load(saved)
    assert embedding.shape == (512,) and embedding.dtype == np.float32
    np.testing.assert_allclose(embedding, reference_embeddings(path, face)[0], atol=1e-5)
    assert inference.main([str(face), "--weights", str(path), *R18]) == 0
    printed = np.array(re.findall(r"-?\d+\.\d+", capsys.readouterr().out.split("\n", 1)[1]), dtype=np.float64)
    assert printed.shape == (512,) and abs(np.linalg.norm(printed) - 1) < 1e-3


def test_inference_cli_prints_the_cosine_similarity_of_two_faces(r18_weights, r18_run, tmp_path, capsys):
    path, _ = r18_weights
    a = write_face(tmp_path / "a.jpg", (112, 112), seed=5)
    b = write_face(tmp_path / "b.png", (112, 112), seed=6)
    args = ["--model", str(r18_run)]
    assert inference.main(args + [str(a), str(b)]) == 0
    printed = float(re.search(r"cosine similarity: (\S+)", capsys.readouterr().out).group(1))
    expected = reference_embeddings(path, a, b)
    assert printed == pytest.approx(float(expected[0] @ expected[1]), abs=1e-5)
    assert inference.main(args + [str(a), str(a)]) == 0
    assert "cosine similarity: 1.000000" in capsys.readouterr().out


def test_inference_judges_a_pair_by_the_threshold_recorded_with_the_model(r18_weights, r18_run, tmp_path, capsys):
    """A threshold just below the pair's similarity says same person, just above it different people; a model
    whose model.json records no verification says that no threshold is known."""
    path, _ = r18_weights
    a, b = write_face(tmp_path / "a.jpg", (112, 112), seed=5), write_face(tmp_path / "b.png", (112, 112), seed=6)
    expected = reference_embeddings(path, a, b)
    similarity = float(expected[0] @ expected[1])
    assert inference.main(["--model", str(r18_run), str(a), str(b)]) == 0
    assert (f"no threshold is known for {r18_run / 'backbone.pth'}: its model.json records no verification"
            in capsys.readouterr().out)
    run = Path(shutil.copytree(r18_run, tmp_path / "run"))
    info = json.loads((run / "model.json").read_text())
    for threshold, verdict in ((similarity - 1e-3, "same person"), (similarity + 1e-3, "different people")):
        point = {"threshold": threshold, "far": 0.0125, "accuracy": 0.9, "pairs": 80, "by": "training, step 40"}
        (run / "model.json").write_text(json.dumps({**info, "verification": {"faces_val": point}}))
        assert inference.main(["--model", str(run), str(a), str(b)]) == 0
        assert (f"{verdict} at threshold {threshold:.4f} (FAR 0.0125 on faces_val, 80 pairs; training, step 40)"
                in capsys.readouterr().out.splitlines())
    # No different-person pair of 30 passed the threshold: that shows a FAR below 1/30, not a FAR of 0.
    point = {"threshold": similarity - 1e-3, "far": 0.0, "accuracy": 0.9, "pairs": 60, "different": 30, "by": "x"}
    (run / "model.json").write_text(json.dumps({**info, "verification": {"faces_val": point}}))
    assert inference.main(["--model", str(run), str(a), str(b)]) == 0
    assert (f"same person at threshold {similarity - 1e-3:.4f} (FAR < 1/30 on faces_val, 60 pairs; x)"
            in capsys.readouterr().out.splitlines())


def test_inference_cli_turns_user_errors_into_one_line(r18_weights, tmp_path, capsys):
    path, _ = r18_weights
    face = write_face(tmp_path / "a.jpg", (112, 112), seed=8)
    (tmp_path / "points.txt").write_text("elsewhere.jpg 38 52 74 52 56 72 42 92 71 92\n")
    err = exits_with(capsys, inference.main, [str(face), "--weights", str(path), "--landmarks",
                                              str(tmp_path / "points.txt"), *R18])
    assert f"{face} has no line in landmarks file {tmp_path / 'points.txt'}" in err
    err = exits_with(capsys, inference.main, ["--network", "vit_t", "--weights", str(path), str(face)])
    assert "fits network r18, width_mult=0.25" in err
    err = exits_with(capsys, inference.main, [str(face), str(face), str(face), "--weights", str(path), *R18])
    assert "3 images given; give one image" in err


def test_inference_takes_an_onnx_model_as_eval_does(r18_weights, tmp_path, capsys):
    path, model = r18_weights
    export_onnx.export_onnx(model, tmp_path / "r18.onnx")
    a, b = write_face(tmp_path / "a.jpg", (112, 112), seed=5), write_face(tmp_path / "b.png", (112, 112), seed=6)
    assert inference.main([str(a), str(b), "--onnx", str(tmp_path / "r18.onnx")]) == 0
    out = capsys.readouterr().out
    expected = reference_embeddings(path, a, b)
    assert float(re.search(r"cosine similarity: (\S+)", out).group(1)) == pytest.approx(
        float(expected[0] @ expected[1]), abs=1e-4)
    assert f"no threshold is known for {tmp_path / 'r18.onnx'}: an ONNX model records no verification" in out
    assert "--network and --network-kw describe PyTorch weights" in exits_with(
        capsys, inference.main, [str(a), "--onnx", str(tmp_path / "r18.onnx"), "--network", "r18"])


def test_the_verdict_names_its_set_and_prefers_the_one_of_people_kept_out_of_training(r18_weights, r18_run, tmp_path,
                                                                                      capsys):
    path, _ = r18_weights
    a, b = write_face(tmp_path / "a.jpg", (112, 112), seed=5), write_face(tmp_path / "b.png", (112, 112), seed=6)
    expected = reference_embeddings(path, a, b)
    similarity = float(expected[0] @ expected[1])
    run = Path(shutil.copytree(r18_run, tmp_path / "run"))
    info = json.loads((run / "model.json").read_text())
    point = {"far": 0.02, "accuracy": 0.9, "pairs": 100, "by": "eval.verification"}
    sets = {"train_people": {**point, "threshold": similarity + 1e-3, "held_out": False},  # recorded first
            "faces_val": {**point, "threshold": similarity - 1e-3, "held_out": True}}
    (run / "model.json").write_text(json.dumps({**info, "verification": sets}))
    assert inference.main(["--model", str(run), str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == ("verdict: same person, by the threshold of faces_val (the largest recorded set of people kept "
                         "out of training)")
    assert lines[-3].startswith("different people at threshold") and "on train_people" in lines[-3]


def test_a_model_trained_on_aligned_photos_asks_for_their_landmarks(r18_run, tmp_path, capsys):
    run = Path(shutil.copytree(r18_run, tmp_path / "run"))
    info = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps({**info, "photo_preparation": "landmarks"}))
    face = write_face(tmp_path / "a.jpg", (112, 112), seed=5)
    assert (f"{run / 'model.json'} records photos aligned by their landmarks (--landmarks); pass --landmarks FILE "
            "with these photos' five points") in exits_with(capsys, inference.main, ["--model", str(run), str(face)])
    assert inference.main(["--model", str(run), str(face), "--resize"]) == 0
    assert "warning: --resize given, but" in capsys.readouterr().err
    (run / "model.json").write_text(json.dumps({**info, "photo_preparation": "squash"}))
    assert "records photo_preparation 'squash', not one of resize, crop, pad, landmarks" in exits_with(
        capsys, inference.main, ["--model", str(run), str(face)])
