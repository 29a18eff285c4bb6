"""tools.search and eval.compare on two tiny runs of the suite's synthetic data (shared: one trains with
the synthetic_val set, the other without), through their command lines.

References: person templates and similarities computed here from the saved backbone (plain
``load_state_dict``, photos decoded by PIL), the threshold read from model.json, the Accuracy-Flip
curve read back from TensorBoard's event files, the IJB TAR table eval.ijb printed.
"""
from __future__ import annotations

import json
import re
import shutil
import statistics

import numpy as np
import pytest
import torch
from PIL import Image

from backbones import get_model
from dataset import render_faces
from eval import compare, ijb
from eval.gallery import gallery_file
from gpu_acceptance.runs import scalars
from tests.run_helpers import run_here
from tests.test_eval_cli import assert_one_sentence, assert_visible_curve
from tests.test_ijb import write_ijb
from tools import search

pytestmark = pytest.mark.slow  # two training runs (100 steps) and an IJB evaluation
TINY = ["batch_size=8", "num_workers=0", "frequent=5"]  # configs/synthetic_pair.py on the 20-identity fixture
PEOPLE = [f"p{identity}" for identity in range(10)]      # training identities, photos drawn afresh
STRANGERS = range(900, 910)                              # never seen in training or in the gallery


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """`verified`: 80 steps, Accuracy-Flip on synthetic_val at steps 40 and 80, then IJB 1:1 on the miniature
    release; `plain`: 20 steps, no verification set."""
    folder = tmp_path_factory.mktemp("runs")
    verified, plain = folder / "verified", folder / "plain"
    assert run_here(data, verified, *TINY, "num_epoch=16", "verbose=40", base=())[0] == 0
    assert run_here(data, plain, *TINY, "num_epoch=4", "val_targets=()", base=())[0] == 0
    write_ijb(str(folder / "IJBC"))
    assert ijb.main(["--model", str(verified), "--root", str(folder / "IJBC"), "--workers", "0"]) == 0
    return verified, plain


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """gallery/pX/0..2.png of the 10 people; queries: photo 7 of each person and photo 0 of each stranger."""
    folder = tmp_path_factory.mktemp("photos")
    for identity, person in enumerate(PEOPLE):
        (folder / "gallery" / person).mkdir(parents=True)
        for number, face in enumerate(render_faces(identity, np.arange(3), seed=0)):
            Image.fromarray(face).save(folder / "gallery" / person / f"{number}.png")
    (folder / "queries").mkdir()
    for identity, person in enumerate(PEOPLE):
        Image.fromarray(render_faces(identity, np.arange(7, 8), seed=0)[0]).save(folder / "queries" / f"{person}.png")
    for identity in STRANGERS:
        Image.fromarray(render_faces(identity, np.arange(1), seed=0)[0]).save(folder / "queries" / f"s{identity}.png")
    return folder


def reference_unit_embeddings(run, paths):
    info = json.loads((run / "model.json").read_text())
    model = get_model(info["network"], num_features=info["embedding_size"], **info["network_kwargs"])
    model.load_state_dict(torch.load(run / "backbone.pth", weights_only=True))
    model.eval()
    faces = torch.from_numpy(np.stack([np.asarray(Image.open(path).convert("RGB")) for path in paths]))
    faces = faces.permute(0, 3, 1, 2).double() / 127.5 - 1
    with torch.no_grad():
        both = (model(faces.float()) + model(faces.flip(3).float())).double().numpy()
    return both / np.linalg.norm(both, axis=1, keepdims=True)


def reference_templates(run, gallery):
    templates = []
    for person in PEOPLE:
        mean = reference_unit_embeddings(run, sorted((gallery / person).glob("*.png"))).mean(axis=0)
        templates.append(mean / np.linalg.norm(mean))
    return np.array(templates)


def searched(capsys, run, gallery, queries, *flags):
    assert search.main(["--model", str(run), "--gallery", str(gallery), *map(str, queries), *flags]) == 0
    captured = capsys.readouterr()
    results, current = {}, None
    for line in captured.out.splitlines():
        if not line.startswith(" "):
            current = results.setdefault(line.rstrip(":"), {"top": [], "verdicts": []})
        elif match := re.fullmatch(r"  \d+\. (\S+) +(-?[\d.]+)", line):
            current["top"].append((match.group(1), float(match.group(2))))
        else:
            current["verdicts"].append(line.strip())
    return results, captured.err


def test_a_gallery_person_is_found_at_rank_1_and_verdicts_follow_the_deciding_threshold(runs, photos, capsys):
    verified, _ = runs
    queries = sorted((photos / "queries").glob("*.png"))
    results, err = searched(capsys, verified, photos / "gallery", queries, "--top", "3")
    assert "gallery: 10 people (30 photos) embedded" in err
    templates = reference_templates(verified, photos / "gallery")
    similarity = reference_unit_embeddings(verified, queries) @ templates.T
    point = json.loads((verified / "model.json").read_text())["verification"]["synthetic_val"]
    said = [re.match(r"known person: a best similarity above ([\d.]+) \(the higher of the two\)", line)
            for line in results]  # the lines before the queries' say the thresholds
    deciding = float(next(match for match in said if match).group(1))
    assert deciding >= round(point["threshold"], 4)  # the pair threshold of the one recorded set is one of the two
    for query, row in zip(queries, similarity):
        result = results[str(query)]
        best = np.argsort(-row)[:3]
        assert [name for name, _ in result["top"]] == [PEOPLE[i] for i in best]
        np.testing.assert_allclose([score for _, score in result["top"]], row[best], atol=2e-4)
        if query.stem in PEOPLE:
            assert result["top"][0][0] == query.stem
        top = result["top"][0][1]
        verdict = (f"known person {PEOPLE[best[0]]} ({top:.4f} > {deciding:.4f})" if top > deciding else
                   f"unknown: not in the gallery (the most similar, {PEOPLE[best[0]]}, scores {top:.4f}, not above "
                   f"{deciding:.4f})")
        assert result["verdicts"] == [verdict]


def test_the_gallery_file_is_reused_and_rebuilt_when_a_photo_or_the_model_changes(runs, photos, tmp_path, capsys):
    verified, plain = runs
    gallery = tmp_path / "gallery"
    shutil.copytree(photos / "gallery", gallery)
    query = photos / "queries" / "p3.png"
    first, err = searched(capsys, verified, gallery, [query])
    assert "embedded" in err
    saved = np.load(gallery_file(gallery), allow_pickle=False)
    assert saved["names"].tolist() == PEOPLE
    np.testing.assert_allclose(saved["features"], reference_templates(verified, gallery), atol=1e-5)

    again, err = searched(capsys, verified, gallery, [query])
    assert err.startswith(f"gallery: 10 people from {gallery_file(gallery)}") and again == first

    Image.fromarray(render_faces(5, np.arange(1), seed=0)[0]).save(gallery / "p3" / "1.png")  # p3's photo replaced
    changed, err = searched(capsys, verified, gallery, [query])
    assert "the photos changed since" in err and "embedded" in err
    np.testing.assert_allclose(np.load(gallery_file(gallery), allow_pickle=False)["features"],
                               reference_templates(verified, gallery), atol=1e-5)
    assert changed[str(query)]["top"] != first[str(query)]["top"]

    _, err = searched(capsys, plain, gallery, [query])
    assert "the model changed since" in err
    np.testing.assert_allclose(np.load(gallery_file(gallery), allow_pickle=False)["features"],
                               reference_templates(plain, gallery), atol=1e-5)


def test_the_gallery_is_prepared_as_model_json_records_and_a_rebuild_says_the_preparation_changed(
        runs, photos, tmp_path, capsys):
    """A model whose photos were packed with --crop; gallery photos 140x112, each a 112x112 face between two
    14-pixel bands of noise: cropped, they are the square photos whose templates reference_templates computes."""
    verified, _ = runs
    model = tmp_path / "cropped_model"
    shutil.copytree(verified, model)
    info = json.loads((model / "model.json").read_text())
    (model / "model.json").write_text(json.dumps({**info, "photo_preparation": "crop"}))
    gallery = tmp_path / "gallery"
    rng = np.random.default_rng(0)
    for person in PEOPLE:
        (gallery / person).mkdir(parents=True)
        for square in sorted((photos / "gallery" / person).glob("*.png")):
            face = np.asarray(Image.open(square))
            bands = [rng.integers(0, 256, (112, 14, 3), dtype=np.uint8) for _ in range(2)]
            Image.fromarray(np.concatenate([bands[0], face, bands[1]], axis=1)).save(gallery / person / square.name)
    query = photos / "queries" / "p3.png"
    _, err = searched(capsys, model, gallery, [query])
    assert f"photos prepared with --crop, as {model / 'model.json'} records" in err and "not square" not in err
    np.testing.assert_allclose(np.load(gallery_file(gallery), allow_pickle=False)["features"],
                               reference_templates(verified, photos / "gallery"), atol=1e-5)

    _, err = searched(capsys, model, gallery, [query], "--resize")
    assert (f"gallery: the photos' preparation (now resize to 112x112, was crop to 112x112) changed since "
            f"{gallery_file(gallery)} was built; building it again") in err.splitlines()
    stretched = [line for line in err.splitlines() if "not square" in line]
    assert len(stretched) == 1 and stretched[0].startswith("warning: 30 of 30 photos are not square"), err


@pytest.mark.parametrize("damage", [lambda data: data[: len(data) // 2], lambda data: b"not a gallery" + data[13:],
                                    lambda data: data[:200] + bytes([data[200] ^ 0xFF]) + data[201:]])
def test_a_damaged_gallery_file_is_refused_in_one_line_until_rebuilt(runs, photos, tmp_path, capsys, damage):
    verified, _ = runs
    gallery = tmp_path / "gallery"
    shutil.copytree(photos / "gallery", gallery)
    query = photos / "queries" / "p1.png"
    searched(capsys, verified, gallery, [query])
    path = gallery_file(gallery)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SystemExit):
        search.main(["--model", str(verified), "--gallery", str(gallery), str(query)])
    message = assert_one_sentence(capsys.readouterr().err)
    assert message.startswith(f"gallery file {path} ") and message.endswith("pass --rebuild to build the gallery again")
    result, err = searched(capsys, verified, gallery, [query], "--rebuild")
    assert "embedded" in err and result[str(query)]["top"][0][0] == "p1"


@pytest.mark.parametrize("arrange, message", [
    (lambda tmp: (tmp / "gallery").mkdir(), r"gallery folder .*gallery holds no person sub-folders"),
    (lambda tmp: (tmp / "gallery" / "anna").mkdir(parents=True), r"gallery person .*anna holds no photos"),
    (lambda tmp: None, r"gallery folder .*gallery does not exist"),
    (lambda tmp: (tmp / "query.png").write_text("not a photo"), r"cannot read image .*query.png"),
])
def test_bad_input_is_one_sentence(runs, tmp_path, capsys, arrange, message):
    verified, _ = runs
    query = tmp_path / "query.png"
    Image.fromarray(render_faces(1, np.arange(1), seed=0)[0]).save(query)
    arrange(tmp_path)
    with pytest.raises(SystemExit):
        search.main(["--model", str(verified), "--gallery", str(tmp_path / "gallery"), str(query)])
    assert re.search(message, assert_one_sentence(capsys.readouterr().err))


# --- eval.compare -----------------------------------------------------------------------------------------


def test_compare_tables_both_runs_with_dashes_for_what_one_did_not_measure(runs, tmp_path, capsys):
    verified, plain = runs
    plot = tmp_path / "runs.png"
    assert compare.main([str(verified), str(plain), "--plot", str(plot)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = [cell.strip() for cell in lines[1].strip("|").split("|")]
    assert header == ["run", "network", "margin", "differs", "classes", "steps", "saved", "synthetic_val last",
                      "synthetic_val best", "IJBC TAR@FAR=0.0001", "IJBC TAR@FAR=1e-05", "images/s"]
    rows = {cells[0]: dict(zip(header, cells)) for cells in
            ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[3:5])}
    curve = scalars(verified, "synthetic_val")
    assert sorted(curve) == [40, 80]
    tar = json.loads((verified / "backbone_ijbc_tar.json").read_text())["tar_at_far"]
    speeds = {run: [float(v) for v in re.findall(r"([\d.]+) images/sec", (run / "training.log").read_text())]
              for run in runs}
    log = (verified / "training.log").read_text()
    spread = dict(re.findall(r"\[synthetic_val\]\[(\d+)\]Accuracy-Flip: [\d.]+\+-([\d.]+)", log))
    spread = {int(step): std for step, std in spread.items()}
    best = min(step for step in curve if curve[step] == max(curve.values()))
    # configs/synthetic_pair.py (CosFace at s=32: verbose 150, num_epoch 6, one val set) and the two runs' --set
    margin = "combined (1.0, 0.0, 0.35) s=32.0"
    assert rows[str(verified)] == {
        "run": str(verified), "network": "r18 (width_mult=0.0625)", "margin": margin,
        "differs": "num_epoch=16, val_targets=('synthetic_val',), verbose=40", "classes": "20", "steps": "80",
        "saved": str(json.loads((verified / "checkpoint.json").read_text())["global_step"]),
        "synthetic_val last": f"{curve[80]:.5f}+-{spread[80]}",
        "synthetic_val best": f"{curve[best]:.5f}+-{spread[best]}",
        "IJBC TAR@FAR=0.0001": f"{tar['0.0001']:.4f}", "IJBC TAR@FAR=1e-05": f"{tar['1e-05']:.4f}",
        "images/s": f"{statistics.median(speeds[verified]):.1f}"}
    assert rows[str(plain)] == {
        "run": str(plain), "network": "r18 (width_mult=0.0625)", "margin": margin,
        "differs": "num_epoch=4, val_targets=(), verbose=150", "classes": "20", "steps": "20",
        "saved": str(json.loads((plain / "checkpoint.json").read_text())["global_step"]),
        "synthetic_val last": "-", "synthetic_val best": "-", "IJBC TAR@FAR=0.0001": "-", "IJBC TAR@FAR=1e-05": "-",
        "images/s": f"{statistics.median(speeds[plain]):.1f}"}
    assert_visible_curve(plot)
    # The differs cells come from each run's record of its config, which holds the values the --set gave.
    recorded = json.loads((verified / "config.json").read_text())
    assert (recorded["config"]["num_epoch"], recorded["config"]["verbose"]) == (16, 40)
    assert "num_epoch=16" in recorded["set"]


def test_compare_without_plot_never_overwrites_an_earlier_plot(runs, tmp_path, capsys, monkeypatch):
    verified, plain = runs
    monkeypatch.chdir(tmp_path)
    assert compare.main([str(verified), str(plain)]) == 0
    first = (tmp_path / "runs_compared.png").read_bytes()
    assert compare.main([str(verified)]) == 0
    assert (tmp_path / "runs_compared.png").read_bytes() == first
    assert_visible_curve(tmp_path / "runs_compared-2.png")
    assert capsys.readouterr().out.splitlines()[-1] == (
        "verification curves: runs_compared-2.png (runs_compared.png was there already: kept)")


def test_compare_errors_are_one_sentence(runs, tmp_path, capsys):
    verified, _ = runs
    (tmp_path / "empty").mkdir()
    damaged = tmp_path / "damaged"
    shutil.copytree(verified, damaged)
    (damaged / "checkpoint.json").write_text('{"global_step": "80"')
    for argv, message in [([str(tmp_path / "empty")], "holds no model.json"),
                          ([str(tmp_path / "nope")], "does not exist"),
                          ([str(damaged), "--plot", str(tmp_path / "x.png")], "does not say which step was saved"),
                          ([str(verified), "--plot", str(tmp_path / "no" / "x.png")], "folder that does not exist")]:
        with pytest.raises(SystemExit):
            compare.main(argv)
        assert message in assert_one_sentence(capsys.readouterr().err)
