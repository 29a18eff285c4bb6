"""tools.search on a gallery of 10,000 people: the first build, then what each later search costs.

A gallery folder of synthetic faces (``--people`` sub-folders, ``--photos`` photos each) and a run folder
holding an untrained backbone (the demo's r18 at 1/16 width, 512-d embeddings: the search cost depends
on the embedding size, not the network) are written to a temporary folder; then ``tools.search`` runs
twice in this process, and the parts of a reused search are timed on their own:
the freshness check (one ``stat`` per photo and the digests), loading the gallery file, embedding one
query photo, and the search of one query against every template (one matrix-vector product and a
partial sort). Ratios: each part's CPU time against the 50 ms a query may take, measured in this run.

    python -m bench.bench_search                       # 10,000 people x 1 photo
    python -m bench.bench_search --people 2000 --photos 3
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from backbones import flip_fused_embeddings, get_model, read_face_image
from backbones.trained import load_saved_backbone
from dataset import render_faces
from eval.gallery import gallery_file, gallery_people, load_gallery, photos_digest, top_matches
from tools import search

BUDGET = 0.050


def write_photos(folder: Path, people: int, photos: int) -> None:
    for person in range(people):
        (folder / f"person{person:05d}").mkdir(parents=True)
        for number, face in enumerate(render_faces(person, np.arange(photos), seed=1)):
            Image.fromarray(face).save(folder / f"person{person:05d}" / f"{number}.jpg", quality=90)


def write_run(folder: Path) -> None:
    folder.mkdir()
    torch.manual_seed(0)
    options = {"width_mult": 0.0625}
    torch.save(get_model("r18", num_features=512, **options).state_dict(), folder / "backbone.pth")
    (folder / "model.json").write_text(json.dumps({"network": "r18", "network_kwargs": options,
                                                   "embedding_size": 512, "num_classes": 1}))


def timed(fn, repeats: int = 1) -> tuple[float, float]:
    """The best of ``repeats`` runs: (wall seconds, CPU seconds of this process). On a shared machine the
    CPU time is what the part costs; the wall time also holds the waits for a core."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--people", type=int, default=10000)
    parser.add_argument("--photos", type=int, default=1, help="photos per person")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        drawing, _ = timed(lambda: write_photos(root / "gallery", args.people, args.photos))
        write_run(root / "run")
        Image.fromarray(render_faces(3, np.arange(5, 6), seed=1)[0]).save(root / "query.jpg")
        argv = ["--model", str(root / "run"), "--gallery", str(root / "gallery"), str(root / "query.jpg")]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            build = timed(lambda: search.main(argv))
            reuse = timed(lambda: search.main(argv), 3)
        gallery = load_gallery(gallery_file(root / "gallery"))
        check = timed(lambda: photos_digest(gallery_people(root / "gallery")), 5)
        load = timed(lambda: load_gallery(gallery_file(root / "gallery")), 5)
        model, _ = load_saved_backbone(root / "run")
        embed = timed(lambda: flip_fused_embeddings(model, read_face_image(root / "query.jpg")[None]), 20)
        query = gallery.features[:1] + np.float32(0.01)
        one = timed(lambda: top_matches(gallery.features, query, 5), 200)

    print(f"tools.search, {args.people} people x {args.photos} photo(s), 512-d templates "
          f"(drawing the photos: {drawing:.1f} s, not counted)")
    print(f"| {'part':<58} | {'wall s':>9} | {'CPU s':>9} | {'CPU / 50 ms':>11} |")
    print(f"|{'-' * 60}|{'-' * 11}|{'-' * 11}|{'-' * 13}|")
    rows = [("first search: embed every photo, save the gallery file", build),
            ("later search, whole command in-process", reuse),
            ("  freshness check: stat every photo, digests", check),
            ("  load the gallery file", load),
            ("  embed one query photo (and its mirror image)", embed),
            ("  search one query (matrix-vector product + top 5)", one)]
    for what, (wall, cpu) in rows:
        print(f"| {what:<58} | {wall:>9.4f} | {cpu:>9.4f} | {cpu / BUDGET:>10.2f}x |")


if __name__ == "__main__":
    main()
