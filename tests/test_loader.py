"""The loader: DistributedSampler's order, worker-independent batches, exact mid-epoch resume."""
from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch.utils.data import DistributedSampler

from dataset import (
    FaceLoader,
    RecordReader,
    RecordWriter,
    build_dataset,
    build_loader,
    encode,
    pack,
    render_faces,
    unpack,
)
from facedata import loader as loader_module
from facedata.device_decode import decode_batch
from facedata.staging import in_background, one_ahead
from utils.errors import DataError

NUM_SAMPLES = 30
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair_rec(pair_records) -> str:
    return pair_records(NUM_SAMPLES, seed=1)


def collect(loader, epochs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        batches += [(images.clone(), labels.clone()) for images, labels in loader]
    return batches


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for (images, labels), (want_images, want_labels) in zip(got, expected):
        assert torch.equal(labels, want_labels) and torch.equal(images, want_images)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_order_is_distributed_samplers(pair_rec, world_size):
    ds = build_dataset(pair_rec, num_views=2)
    for rank in range(world_size):
        loader = build_loader(ds, 4, rank=rank, world_size=world_size, seed=5, num_workers=0)
        reference = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=5, drop_last=True)
        for epoch in (0, 3):
            loader.set_epoch(epoch)
            reference.set_epoch(epoch)
            order = list(reference)
            expected = [order[i:i + 4] for i in range(0, len(order) - len(order) % 4, 4)]
            got = [labels.tolist() for _, labels in loader]
            assert got == expected and len(loader) == len(expected)


def test_ranks_take_disjoint_slices(pair_rec):
    ds = build_dataset(pair_rec, num_views=2)
    seen = [set(torch.cat([labels for _, labels in build_loader(ds, 3, rank=r, world_size=2, num_workers=0)]).tolist())
            for r in range(2)]
    assert not seen[0] & seen[1] and len(seen[0]) == len(seen[1]) == 15


def test_batches_do_not_depend_on_num_workers(pair_rec):
    ds = build_dataset(pair_rec, num_views=2, flip=True, seed=7)
    single = collect(build_loader(ds, 4, seed=1, num_workers=0), range(2))
    with build_loader(ds, 4, seed=1, num_workers=2) as loader:  # its workers end with the test
        assert_same_batches(collect(loader, range(2)), single)
    first = single[0][0]
    assert first.shape == (4, 2, 3, 112, 112) and first.dtype == torch.uint8


@pytest.mark.parametrize("start", [3, 7, 14])  # mid-epoch, last batch of an epoch, mid second epoch
def test_steps_from_any_start_are_the_uninterrupted_batches(pair_rec, start):
    """A resumed run asks for the steps from its saved step on: it gets what the uninterrupted run got."""
    ds = build_dataset(pair_rec, num_views=2, flip=True, seed=7)
    uninterrupted = collect(build_loader(ds, 4, seed=2, num_workers=0), range(3))  # 7 batches per epoch
    with build_loader(ds, 4, seed=2, num_workers=1) as resumed:
        steps = list(resumed.steps(start, 21))
    assert all(len(micro_batches) == 1 for micro_batches in steps)
    assert_same_batches([micro_batches[0] for micro_batches in steps], uninterrupted[start:])


def test_steps_group_micro_batches_and_drop_an_epochs_leftover(pair_rec):
    """7 batches per epoch, 2 per step: 3 steps an epoch, the 7th batch of each epoch unused."""
    ds = build_dataset(pair_rec, num_views=2, seed=7)
    batches = collect(build_loader(ds, 4, seed=2, num_workers=0), range(2))
    steps = list(build_loader(ds, 4, seed=2, num_workers=0).steps(1, 5, batches_per_step=2))
    expected = [batches[2:4], batches[4:6], batches[7:9], batches[9:11]]
    assert len(steps) == 4
    for got, want in zip(steps, expected):
        assert_same_batches(got, want)


def test_length_and_drop_last(pair_rec):
    ds = build_dataset(pair_rec, num_views=2)
    kept = build_loader(ds, 4, world_size=2, num_workers=0)
    assert len(kept) == 3 and [len(label) for _, label in kept] == [4, 4, 4]
    partial = build_loader(ds, 4, world_size=2, num_workers=0, drop_last=False)
    assert len(partial) == 4 and [len(label) for _, label in partial] == [4, 4, 4, 3]


def test_skipped_records_are_summed_over_workers(tmp_path, pair_rec):
    # Damage two records; each time the epoch meets one, the next sample stands in and it is counted.
    reader = RecordReader(f"{pair_rec}/train.idx", f"{pair_rec}/train.rec")
    bad_keys = {5, 17}
    with RecordWriter(str(tmp_path / "train.idx"), str(tmp_path / "train.rec")) as writer:
        for key in reader.keys:
            header, payload = unpack(reader.read(key))
            writer.write(key, pack(header, b"garbage" if key in bad_keys else payload))
    ds = build_dataset(str(tmp_path), num_views=2, skip_bad_records=True)
    order = list(DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3, drop_last=True))
    with build_loader(ds, 4, seed=3, num_workers=2) as loader:
        expected = sum(1 for i in order[:len(loader) * 4] if i + 1 in bad_keys)  # sample i is key i + 1
        labels = torch.cat([labels for _, labels in loader])
        assert loader.skipped == expected > 0
    assert set(labels.tolist()).isdisjoint({k - 1 for k in bad_keys})


def damaged_copy(pair_rec: str, folder, bad_keys: dict[int, bytes]) -> str:
    """``pair_rec`` with the payloads of ``bad_keys`` replaced; sample i is key i + 1."""
    reader = RecordReader(f"{pair_rec}/train.idx", f"{pair_rec}/train.rec")
    with RecordWriter(str(folder / "train.idx"), str(folder / "train.rec")) as writer:
        for key in reader.keys:
            header, payload = unpack(reader.read(key))
            writer.write(key, pack(header, bad_keys.get(key, payload)))
    return str(folder)


# --- handing batches over one ahead ---------------------------------------------------------------

def test_one_ahead_stages_the_next_item_before_handing_over_and_raises_errors_in_place():
    events = []

    def items():
        for i in range(4):
            events.append(f"fetch {i}")
            if i == 3:
                raise DataError("record 3 is bad; fix it")
            yield i

    def stage(i):
        events.append(f"stage {i}")
        return i * 10

    got = []
    with pytest.raises(DataError, match="record 3"):
        for staged in one_ahead(items(), stage):
            events.append(f"use {staged}")
            got.append(staged)
    assert got == [0, 10, 20]  # every good item reaches the consumer before the error
    assert events == ["fetch 0", "stage 0", "fetch 1", "stage 1", "use 0", "fetch 2", "stage 2", "use 10",
                      "fetch 3", "use 20"]


@pytest.mark.parametrize("count", [0, 1, 3])
def test_one_ahead_hands_over_everything_in_order(count):
    assert list(one_ahead(range(count), lambda i: -i)) == [-i for i in range(count)]


def test_in_background_stages_ahead_on_its_own_thread_while_the_consumer_holds_an_item():
    """What decoding on the GPU needs to overlap the step: items 1 and 2 are staged, on another thread, while
    the consumer still holds item 0 and asks for nothing (one_ahead would stage item 2 only when asked for 1)."""
    staged = {i: threading.Event() for i in range(4)}
    threads = []

    def stage(i):
        threads.append(threading.current_thread())
        staged[i].set()
        return i * 10

    handed = in_background(range(4), stage, CPU, depth=2)
    assert next(handed) == 0
    assert staged[1].wait(10) and staged[2].wait(10)
    assert list(handed) == [10, 20, 30]
    assert threads and all(thread is not threading.main_thread() for thread in threads)


def test_in_background_raises_errors_in_place_and_stops_its_thread_when_closed():
    def items(closed):
        try:
            for i in range(4):
                if i == 3:
                    raise DataError("record 3 is bad; fix it")
                yield i
        finally:
            closed.set()

    got = []
    with pytest.raises(DataError, match="record 3"):
        for staged in in_background(items(threading.Event()), lambda i: i * 10, CPU):
            got.append(staged)
    assert got == [0, 10, 20]  # every good item reaches the consumer before the error
    closed = threading.Event()
    handed = in_background(items(closed), lambda i: i, CPU)
    assert next(handed) == 0
    handed.close()
    assert closed.is_set() and not any(t.name == "batch staging" for t in threading.enumerate())


@pytest.mark.parametrize("count", [0, 1, 5])
def test_in_background_hands_over_everything_in_order(count):
    assert list(in_background(range(count), lambda i: -i, CPU, depth=1)) == [-i for i in range(count)]


@pytest.mark.parametrize("decode_on_device", [False, True])
def test_a_bad_record_fails_after_the_batches_before_it(tmp_path, pair_rec, decode_on_device):
    ds = build_dataset(pair_rec, num_views=2)
    order = list(DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3, drop_last=True))
    bad_batch = 4
    bad = build_dataset(damaged_copy(pair_rec, tmp_path, {order[bad_batch * 4 + 2] + 1: b"\xff\xd8garbage"}),
                        num_views=2)
    loader = FaceLoader(bad, 4, 0, 1, 3, 0, torch.device("cpu"), True, decode_on_device=decode_on_device)
    got = []
    with pytest.raises(DataError, match=f"record key {order[bad_batch * 4 + 2] + 1} is not a decodable image"):
        for _, labels in loader:
            got.append(labels.tolist())
    assert got == [order[b * 4:(b + 1) * 4] for b in range(bad_batch)]


# --- decoding in the training process (dali=True) ---------------------------------------------------

def image_folder(root, identities: int, per_identity: int) -> str:
    """Single 112x112 faces, one sub-folder per identity, JPEG and PNG mixed."""
    for identity in range(identities):
        folder = root / f"id{identity}"
        folder.mkdir(parents=True)
        for i, face in enumerate(render_faces(identity, range(per_identity), seed=4)):
            kind = "png" if (identity + i) % 3 == 0 else "jpeg"
            (folder / f"{i}.{kind[:3]}").write_bytes(encode(face, kind))
    return str(root)


def decoded_here(ds, batch_size, seed, num_workers, steps=(0, 14)):
    with FaceLoader(ds, batch_size, 0, 1, seed, num_workers, torch.device("cpu"), True,
                    decode_on_device=True) as loader:
        return [batch for step in loader.steps(*steps) for batch in step]


def decoded_in_workers(ds, batch_size, seed, steps=(0, 14)):
    return [batch for step in build_loader(ds, batch_size, seed=seed, num_workers=0).steps(*steps) for batch in step]


@pytest.mark.parametrize("augmentation", [{}, {"dali_aug": True}, {"crop_scale": (0.6, 1.0), "erase_p": 0.5},
                                          {"dali_aug": True, "crop_scale": (0.8, 0.9), "erase_p": 1.0}])
def test_decoding_in_the_training_process_gives_the_workers_batches(pair_rec, augmentation):
    """The split the GPU path makes (bytes and draws in the workers, decode + views + flips + crop_scale,
    dali_aug, erase_p in the training process), run with the CPU decoder: the same batches, from any start."""
    ds = build_dataset(pair_rec, num_views=2, seed=6, **augmentation)
    expected = decoded_in_workers(ds, 4, seed=2)
    assert_same_batches(decoded_here(ds, 4, seed=2, num_workers=2), expected)
    assert_same_batches(decoded_here(ds, 4, seed=2, num_workers=0, steps=(9, 14)), expected[9:])


def test_decoding_in_the_training_process_runs_on_the_staging_thread(pair_rec, monkeypatch):
    """Decoding a batch takes as long as a step: on the training thread it could not overlap the step."""
    threads = []

    def decode_and_note_the_thread(*args):
        threads.append(threading.current_thread().name)
        return decode_batch(*args)

    monkeypatch.setattr(loader_module, "decode_batch", decode_and_note_the_thread)
    decoded_here(build_dataset(pair_rec, num_views=2), 4, seed=2, num_workers=0, steps=(0, 3))
    assert len(threads) >= 3 and set(threads) == {"batch staging"}  # and a batch or two ahead


def test_decoding_in_the_training_process_with_identity_views_and_png(tmp_path):
    ds = build_dataset(image_folder(tmp_path / "faces", 6, 4), num_views=3, view_source="identity", seed=1,
                       dali_aug=True)
    assert_same_batches(decoded_here(ds, 4, seed=5, num_workers=1, steps=(0, 12)),
                        decoded_in_workers(ds, 4, seed=5, steps=(0, 12)))


def test_decoding_in_the_training_process_skips_bad_records_as_the_workers_do(tmp_path, pair_rec):
    # Key 4: JPEG-looking garbage, found by the decoder in the training process; key 9: found in the worker.
    ds = build_dataset(damaged_copy(pair_rec, tmp_path, {4: b"\xff\xd8garbage", 9: b""}), num_views=2,
                       skip_bad_records=True, dali_aug=True)
    in_workers = build_loader(ds, 4, seed=3, num_workers=0)
    with FaceLoader(ds, 4, 0, 1, 3, 2, torch.device("cpu"), True, decode_on_device=True) as here:
        assert_same_batches(collect(here, range(2)), collect(in_workers, range(2)))
        assert here.skipped == in_workers.skipped > 0


def test_gpu_decode_without_a_gpu_says_so_once_and_decodes_in_the_workers(pair_rec, caplog):
    ds = build_dataset(pair_rec, num_views=2, dali_aug=True)
    with caplog.at_level(logging.WARNING, logger="facedata.loader"):
        loader = build_loader(ds, 4, num_workers=0, gpu_decode=True)
        batches = collect(loader, range(1))
    assert [r.getMessage() for r in caplog.records] == [
        "dali=True but no GPU: decoding JPEG on the CPU, in the data workers"]
    assert not loader.decode_on_device
    assert_same_batches(batches, collect(build_loader(ds, 4, num_workers=0), range(1)))


def test_datasets_that_cannot_hand_over_bytes_say_why(pair_rec):
    assert build_dataset(pair_rec, num_views=2).encoded_refusal() is None
    assert "synthetic" in build_dataset("synthetic", num_views=2, num_classes=10).encoded_refusal()
    assert "augment" in build_dataset(pair_rec, num_views=1, view_source="augment").encoded_refusal()


# --- on a GPU ---------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_decoded_batches_match_cpu_decoded_ones(pair_rec):
    """nvJPEG and libjpeg-turbo round differently: the same batches within the decoders' difference
    (and, for crop_scale, the GPU's float resize against the CPU's uint8 one: a level at most)."""
    ds = build_dataset(pair_rec, num_views=2, seed=4, dali_aug=True, crop_scale=(0.7, 1.0), erase_p=0.5)
    on_cpu = collect(build_loader(ds, 4, num_workers=0), range(2))
    loader = build_loader(ds, 4, num_workers=2, device="cuda", gpu_decode=True)
    assert loader.decode_on_device
    on_gpu = collect(loader, range(2))
    for (images, labels), (want_images, want_labels) in zip(on_gpu, on_cpu):
        assert images.is_cuda and torch.equal(labels.cpu(), want_labels)
        difference = (images.cpu().float() - want_images.float()).abs()
        # a wrong view, flip or augmentation would be tens of levels off on average
        assert difference.mean() < 2.0 and (difference <= 8).float().mean() > 0.99


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_batches_arrive_on_the_device_unchanged(pair_rec):
    ds = build_dataset(pair_rec, num_views=2, seed=4)
    on_cpu = collect(build_loader(ds, 4, num_workers=0), range(2))
    on_gpu = collect(build_loader(ds, 4, num_workers=2, device="cuda"), range(2))
    assert all(images.is_cuda and labels.is_cuda for images, labels in on_gpu)
    assert_same_batches([(i.cpu(), label.cpu()) for i, label in on_gpu], on_cpu)


# --- what mutation testing found unchecked ---------------------------------------------------------

def test_a_fresh_loader_walks_epoch_zero_from_its_first_batch(pair_rec):
    ds = build_dataset(pair_rec, num_views=2)
    order = list(DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=4, drop_last=True))
    got = [labels.tolist() for _, labels in build_loader(ds, 6, seed=4, num_workers=0)]
    assert got == [order[i:i + 6] for i in range(0, 30, 6)]


@pytest.mark.parametrize("batch_size, lengths", [(5, [5] * 6), (29, [29, 1]), (30, [30])])
def test_without_drop_last_the_last_batch_is_whatever_is_left(pair_rec, batch_size, lengths):
    loader = build_loader(build_dataset(pair_rec, num_views=2), batch_size, num_workers=0, drop_last=False)
    assert len(loader) == len(lengths) and [len(labels) for _, labels in loader] == lengths


def test_one_batch_is_enough_and_none_is_an_error(pair_rec):
    ds = build_dataset(pair_rec, num_views=2)
    assert len(build_loader(ds, 30, num_workers=0)) == 1
    with pytest.raises(DataError, match="give rank 0 of 1 no batch of 31"):
        build_loader(ds, 31, num_workers=0)


@pytest.mark.parametrize("rank, world_size, batch_size", [(2, 2, 4), (-1, 2, 4), (0, 1, 0)])
def test_impossible_setups_are_refused(pair_rec, rank, world_size, batch_size):
    with pytest.raises(ValueError, match="not a valid setup"):
        build_loader(build_dataset(pair_rec, num_views=2), batch_size, rank=rank, world_size=world_size)


def test_batch_size_one_and_the_last_rank_are_valid(pair_rec):
    loader = build_loader(build_dataset(pair_rec, num_views=2), 1, rank=1, world_size=2, num_workers=0)
    assert len(loader) == 15


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bad_record_stops_the_loader_with_its_data_error(tmp_path, pair_rec, workers):
    """Without skip_bad_records the record's own one-sentence error reaches the training process, also
    from a worker process (not the worker's traceback)."""
    reader = RecordReader(f"{pair_rec}/train.idx", f"{pair_rec}/train.rec")
    with RecordWriter(str(tmp_path / "train.idx"), str(tmp_path / "train.rec")) as writer:
        for key in reader.keys:
            header, payload = unpack(reader.read(key))
            writer.write(key, pack(header, b"garbage" if key == 5 else payload))
    with build_loader(build_dataset(str(tmp_path), num_views=2), 30, num_workers=workers) as loader, \
            pytest.raises(DataError, match=r"record key 5 is not a decodable image") as raised:
        next(iter(loader))
    assert "Traceback" not in str(raised.value)


def test_loading_draws_nothing_from_torchs_global_generator(pair_rec):
    """Centre sampling and dropout draw from torch's global generator: a loader that drew from it (a
    DataLoader draws a worker seed at every epoch start) would change them at each epoch."""
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with build_loader(build_dataset(pair_rec, num_views=2), 4, num_workers=1) as loader:
        collect(loader, range(2))
    assert torch.equal(torch.get_rng_state(), state)


def test_the_skipped_count_travels_through_state_dict(pair_rec):
    ds = build_dataset(pair_rec, num_views=2)
    saved = build_loader(ds, 4, num_workers=0)
    saved.skipped = 3
    resumed = build_loader(ds, 4, num_workers=0)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.skipped == 3
