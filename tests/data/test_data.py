import numpy as np
import pytest
from PIL import Image

from qprep.data import load_samples
from qprep.errors import DataError
from qprep.model.info import TensorSpec, graph_inputs
from graphs import tiny_conv_model, two_input_model

CONV_INPUTS = graph_inputs(tiny_conv_model())
TWO_INPUTS = graph_inputs(two_input_model())


def source(folder, **kw):
    cfg = {"source": str(folder), "format": "auto", "max_samples": 64, "seed": 0,
           "preprocess": {"mean": None, "std": None, "channel_order": "rgb", "layout": "auto", "resize": "stretch"}}
    cfg.update(kw)
    return cfg


def test_npz_multi_input_keeps_integer_token_ids(tmp_path):
    for i in range(3):
        np.savez(tmp_path / f"{i}.npz", ids=np.arange(5, dtype=np.int64)[None], mask=np.ones((1, 5), np.float32))
    samples = load_samples(source(tmp_path), TWO_INPUTS)
    assert len(samples) == 3 and samples.format == "npz"
    assert samples.samples[0]["ids"].dtype == np.int64
    assert samples.warnings == ["calibration: only 3 samples: a set smaller than a few dozen (32) may not stand for "
                                "the deployment's inputs; add samples if you have them"]
    assert load_samples(source(tmp_path, max_samples=4), TWO_INPUTS).warnings == [
        "calibration: 3 samples found, fewer than max_samples=4; using all of them"]


def test_the_samples_the_readme_asks_for_are_no_warning_under_the_default_cap(tmp_path):
    """Issue #59: every run warned "32 samples … fewer than 64" although the README asks for a few dozen: the
    cap is a ceiling, a set of 32 under it is no problem."""
    for i in range(32):
        np.savez(tmp_path / f"{i}.npz", ids=np.arange(5, dtype=np.int64)[None], mask=np.ones((1, 5), np.float32))
    assert load_samples(source(tmp_path), TWO_INPUTS).warnings == []
    assert load_samples(source(tmp_path, max_samples=128), TWO_INPUTS, role="evaluation").warnings == []


def test_npz_shape_mismatch_is_one_line(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.zeros((1, 3, 16, 16), np.float32))
    with pytest.raises(DataError, match=r"^calibration sample a.npz: input 'x' has shape \[1, 3, 16, 16\], "
                                        r"the model expects \['N', 3, 8, 8\] \(dim 2 must be 8\)$"):
        load_samples(source(tmp_path), CONV_INPUTS)


def test_wrong_key_dtype_nan_and_empty(tmp_path):
    (tmp_path / "k").mkdir()
    np.savez(tmp_path / "k" / "a.npz", idz=np.zeros((1, 5), np.int64), mask=np.ones((1, 5), np.float32))
    with pytest.raises(DataError, match="no array named 'ids'.*found 'idz'"):
        load_samples(source(tmp_path / "k"), TWO_INPUTS)
    (tmp_path / "d").mkdir()
    np.savez(tmp_path / "d" / "a.npz", ids=np.zeros((1, 5), np.int32), mask=np.ones((1, 5), np.float32))
    with pytest.raises(DataError, match="input 'ids' is int32, the model expects int64; save the samples as int64"):
        load_samples(source(tmp_path / "d"), TWO_INPUTS)
    (tmp_path / "n").mkdir()
    bad = np.zeros((1, 3, 8, 8), np.float32)
    bad[0, 0, 0, :2] = [np.nan, np.inf]
    np.save(tmp_path / "n" / "a.npy", bad)
    with pytest.raises(DataError, match="holds 2 NaN/Inf values"):
        load_samples(source(tmp_path / "n"), CONV_INPUTS)
    (tmp_path / "e").mkdir()
    with pytest.raises(DataError, match="holds no samples"):
        load_samples(source(tmp_path / "e"), CONV_INPUTS)
    with pytest.raises(DataError, match="folder not found"):
        load_samples(source(tmp_path / "missing"), CONV_INPUTS)


def test_npy_needs_single_input_model(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((1, 5), np.int64))
    with pytest.raises(DataError, match=r"\.npy samples need a single-input model.*\.npz keyed by input name"):
        load_samples(source(tmp_path), TWO_INPUTS)


def test_a_sample_without_its_batch_dim_is_refused_naming_split_file_input_and_shapes(tmp_path):
    """[3, 8, 8] for an input [N, 3, 8, 8] was given a batch axis silently (the README asks for the batch dim; an
    axis guessed could as well be a missing channel): refused in one line with the fix, for .npy and .npz."""
    np.save(tmp_path / "a.npy", np.ones((3, 8, 8), np.float32))
    with pytest.raises(DataError) as raised:
        load_samples(source(tmp_path), CONV_INPUTS, role="evaluation")
    assert str(raised.value) == (
        "evaluation sample a.npy: input 'x' has shape [3, 8, 8], the model expects rank 4 ['N', 3, 8, 8]; the "
        "sample lacks the batch dim: save it as x[None] (shape [1, 3, 8, 8]), one sample per file with the batch "
        "dim included")
    (tmp_path / "z").mkdir()
    np.savez(tmp_path / "z" / "b.npz", ids=np.arange(5, dtype=np.int64), mask=np.ones((1, 5), np.float32))
    with pytest.raises(DataError, match=r"^calibration sample b.npz: input 'ids' has shape \[5\], .* lacks the batch"):
        load_samples(source(tmp_path / "z"), TWO_INPUTS)
    four = [TensorSpec("x", "float32", [4, 3, 8, 8])]  # a fixed batch of 4: one sample with x[None] fails on dim 0
    with pytest.raises(DataError, match=r"lacks the batch dim: the model takes 4 at once, save them stacked$"):
        load_samples(source(tmp_path), four)


def test_every_sample_error_names_its_split_and_file(tmp_path):
    """An error of the reader (an .npz without the input's array, an unreadable file, a list's line) names the
    split it came from beside the file: the held-out folder's bad file read as the evaluation's otherwise."""
    np.savez(tmp_path / "a.npz", idz=np.zeros((1, 5), np.int64), mask=np.ones((1, 5), np.float32))
    with pytest.raises(DataError, match=r"^evaluation.heldout: a.npz: no array named 'ids' for the model's input"):
        load_samples(source(tmp_path), TWO_INPUTS, role="evaluation.heldout")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bad.npy").write_bytes(b"not an array")
    with pytest.raises(DataError, match=r"^evaluation: .*bad.npy: cannot read it as .npy"):
        load_samples(source(tmp_path / "b"), CONV_INPUTS, role="evaluation")
    (tmp_path / "list.txt").write_text("b/bad.npy\n")
    with pytest.raises(DataError, match=r"^calibration: .*bad.npy: cannot read it as .npy"):
        load_samples(source(tmp_path / "list.txt"), CONV_INPUTS)


def test_max_samples_is_a_seeded_sorted_subset(tmp_path):
    for i in range(10):
        np.save(tmp_path / f"{i:02d}.npy", np.full((1, 3, 8, 8), i, np.float32))
    first = load_samples(source(tmp_path, max_samples=4, seed=1), CONV_INPUTS)
    again = load_samples(source(tmp_path, max_samples=4, seed=1), CONV_INPUTS)
    other = load_samples(source(tmp_path, max_samples=4, seed=2), CONV_INPUTS)
    assert first.files == again.files and first.sha256 == again.sha256
    assert first.files == sorted(first.files) and len(first.files) == 4
    assert first.files != other.files


def test_images_are_resized_normalized_and_laid_out(tmp_path):
    img = np.zeros((16, 16, 3), np.uint8)
    img[..., 0] = 255  # pure red
    Image.fromarray(img).save(tmp_path / "a.png")
    pre = {"mean": [127.5], "std": [127.5], "channel_order": "bgr", "layout": "auto", "resize": "stretch"}
    x = load_samples(source(tmp_path, preprocess=pre), CONV_INPUTS).samples[0]["x"]
    assert x.shape == (1, 3, 8, 8) and x.dtype == np.float32
    assert np.allclose(x[0, 2], 1.0) and np.allclose(x[0, 0], -1.0)  # red lands in the last (BGR) channel


def test_unreadable_image_names_the_file(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match=r"broken.png: not a readable image"):
        load_samples(source(tmp_path), CONV_INPUTS)


def test_dataset_txt_list_feeds_multi_input_models_in_input_order(tmp_path):
    (tmp_path / "npy").mkdir()
    lines = []
    for i in range(3):
        np.save(tmp_path / "npy" / f"ids{i}.npy", np.full((1, 4), i, np.int64))
        np.save(tmp_path / "npy" / f"mask{i}.npy", np.ones((1, 4), np.float32))
        lines.append(f"npy/ids{i}.npy npy/mask{i}.npy")
    (tmp_path / "dataset.txt").write_text("\n".join(lines) + "\n")
    samples = load_samples(source(tmp_path / "dataset.txt"), TWO_INPUTS)
    assert samples.format == "list" and len(samples) == 3
    assert samples.samples[2]["ids"].tolist() == [[2, 2, 2, 2]]
    (tmp_path / "bad.txt").write_text("# ids mask\nnpy/ids0.npy npy/mask0.npy\n\nnpy/ids1.npy\n")
    with pytest.raises(DataError, match=r"bad.txt line 4: 1 files for 2 model inputs \(ids, mask\)"):
        load_samples(source(tmp_path / "bad.txt"), TWO_INPUTS)  # the file's line, comments and blanks counted
    before = samples.sha256
    np.save(tmp_path / "npy" / "mask1.npy", np.zeros((1, 4), np.float32))  # only the second input's file
    assert load_samples(source(tmp_path / "dataset.txt"), TWO_INPUTS).sha256 != before


def test_random_samples_give_a_named_dim_one_size_across_inputs():
    """Inputs that share a symbolic dim (ids [batch, seq], positions [seq]) must get the same size, or the
    model cannot run on the verification samples; unknown dims ("?") are not a shared name."""
    from qprep.data import random_samples
    from qprep.model.info import TensorSpec

    specs = [TensorSpec("positions", "int64", ["seq"]), TensorSpec("ids", "int64", ["batch", "seq"]),
             TensorSpec("image", "float32", ["?", 3, "?", "?"])]
    sample = random_samples(specs, 1).samples[0]
    assert sample["positions"].shape[0] == sample["ids"].shape[1]
    assert sample["ids"].shape[0] == 1 and sample["image"].shape == (1, 3, 32, 32)


def png16(path, pixels: np.ndarray) -> None:
    """A 16-bit-per-channel PNG of HxW (gray), HxWx3 (RGB) or HxWx4 (RGBA) uint16 pixels, written by hand:
    Pillow writes 16-bit gray only."""
    import struct
    import zlib

    height, width = pixels.shape[:2]
    rows = b"".join(b"\x00" + pixels[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    color_type = {1: 0, 3: 2, 4: 6}[1 if pixels.ndim == 2 else pixels.shape[2]]  # gray, RGB, RGBA
    header = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
                     + chunk(b"IEND", b""))


GRAY16 = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000 + 300)  # 300..63300: all but one above 255


@pytest.mark.parametrize("writer", ["pillow", "by hand"])
def test_16_bit_gray_images_keep_their_depth_in_0_to_255_units(tmp_path, writer):
    """Issue #57: convert("RGB") clipped every 16-bit value to 255 (an all-white image, silently)."""
    if writer == "pillow":
        Image.fromarray(GRAY16).save(tmp_path / "a.png")
        assert Image.open(tmp_path / "a.png").mode == "I;16"
    else:
        png16(tmp_path / "a.png", GRAY16)
    samples = load_samples(source(tmp_path), CONV_INPUTS)
    x = samples.samples[0]["x"]
    expected = GRAY16.astype(np.float32) * 255 / 65535
    assert x.dtype == np.float32 and np.allclose(x[0], expected[None].repeat(3, 0), atol=1e-4)
    assert any("16 bits per channel" in w and "a.png" in w for w in samples.warnings)


def test_16_bit_images_are_resized_at_their_depth(tmp_path):
    big = np.kron(GRAY16, np.ones((2, 2), np.uint16))  # 16x16 → the model's 8x8
    Image.fromarray(big).save(tmp_path / "a.png")
    x = load_samples(source(tmp_path), CONV_INPUTS).samples[0]["x"]
    resized = np.asarray(Image.fromarray(big.astype(np.float32)).resize((8, 8), Image.BILINEAR))
    assert np.allclose(x[0, 0], resized * 255 / 65535, atol=1e-3) and x.max() > 200 and x.min() < 10


def test_raw_pixels_of_a_16_bit_image_are_rounded_not_clipped(tmp_path):
    """read_raw feeds an NPU that takes uint8 pixels (rknn, normalizing on chip): v·255/65535 rounded."""
    Image.fromarray(GRAY16).save(tmp_path / "a.png")
    samples = load_samples(source(tmp_path), CONV_INPUTS)
    raw = samples.image_reader.read_raw(tmp_path / "a.png")
    assert raw.dtype == np.uint8 and raw.shape == (1, 3, 8, 8)
    assert np.array_equal(raw[0, 1], np.rint(GRAY16.astype(np.float64) * 255 / 65535).astype(np.uint8))


@pytest.mark.parametrize("channels", [3, 4])
def test_16_bit_color_images_pillow_reads_at_8_bits_are_refused(tmp_path, channels):
    """Pillow opens a 48/64-bit PNG as RGB/RGBA holding each value's high byte: depth lost without a word."""
    png16(tmp_path / "a.png", np.stack([GRAY16] * channels, axis=-1))
    assert Image.open(tmp_path / "a.png").mode == ("RGB" if channels == 3 else "RGBA")
    with pytest.raises(DataError, match=r"^[^\n]*a.png: [^\n]*16 bits per channel[^\n]*Pillow reads only "
                                        r"at 8 bits[^\n]*$"):
        load_samples(source(tmp_path), CONV_INPUTS)


@pytest.mark.parametrize("suffix", [".jpg", ".png"])
def test_an_image_is_read_upright_as_its_exif_orientation_says(tmp_path, suffix):
    """A camera stores a 12 wide x 4 high frame sideways (4x12) with Orientation 6 (turn 90° clockwise to
    view): read as stored it was the wrong size for the model's [1, 3, 4, 12] input (or calibrated on sideways)."""
    rows, cols = np.mgrid[0:4, 0:12]
    upright = np.stack([rows * 60, cols * 20, np.full_like(rows, 128)], axis=-1).astype(np.uint8)
    stored = Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90)  # 4 wide, 12 high
    exif = Image.Exif()
    exif[0x0112] = 6
    lossless = {"quality": 100, "subsampling": 0} if suffix == ".jpg" else {}  # JPEG: as near as it gets
    stored.save(tmp_path / f"a{suffix}", exif=exif, **lossless)
    inputs = [TensorSpec("x", "float32", [1, 3, 4, 12])]
    pre = {"mean": None, "std": None, "channel_order": "rgb", "layout": "auto", "resize": "none"}
    x = load_samples(source(tmp_path, preprocess=pre), inputs).samples[0]["x"]
    assert x.shape == (1, 3, 4, 12)
    assert np.abs(x[0].transpose(1, 2, 0) - upright).max() <= (0 if suffix == ".png" else 12)


@pytest.mark.parametrize("role", ["calibration", "evaluation", "evaluation.heldout"])
def test_a_sample_with_no_elements_is_refused_in_every_split(tmp_path, role):
    """Rows [0, 4] for an input [N, 4]: its outputs are empty, so the agreement was "met" over nothing and the
    calibration divided by zero. Refused in one line naming split, file, input and shape; a folder, a list."""
    inputs = [TensorSpec("x", "float32", ["N", 4])]
    np.save(tmp_path / "a.npy", np.ones((1, 4), np.float32))
    np.save(tmp_path / "b.npy", np.zeros((0, 4), np.float32))
    message = rf"^{role}(: | sample )b.npy: input 'x' has shape \[0, 4\], no elements \(dim 0 is 0[^\n]*$"
    with pytest.raises(DataError, match=message):
        load_samples(source(tmp_path), inputs, role=role)
    (tmp_path / "list.txt").write_text("a.npy\nb.npy\n")
    with pytest.raises(DataError, match=message):
        load_samples(source(tmp_path / "list.txt"), inputs, role=role)
    np.savez(tmp_path / "c.npz", x=np.ones((1, 4), np.float32), y=np.zeros((1, 0), np.float32))
    two = [TensorSpec("x", "float32", ["N", 4]), TensorSpec("y", "float32", ["N", 0])]  # the model's own empty dim
    assert len(load_samples(source(tmp_path, format="npz"), two, role=role)) == 1


def test_an_empty_key_value_cache_is_a_sample():
    """A decoder's first step feeds a past of length 0 ([1, heads, 0, dim]): its outputs are not empty, and the
    sample is the one a deployment feeds first; only no rows (dim 0) is refused."""
    from qprep.data.samples import check_sample

    inputs = [TensorSpec("past", "float32", [1, 2, "past", 4]), TensorSpec("x", "float32", ["N", 4])]
    check_sample({"past": np.zeros((1, 2, 0, 4), np.float32), "x": np.ones((1, 4), np.float32)}, inputs, "s")
    with pytest.raises(DataError, match="no elements"):
        check_sample({"past": np.zeros((1, 2, 0, 4), np.float32), "x": np.ones((0, 4), np.float32)}, inputs, "s")


def test_a_list_mixing_images_and_other_files_names_the_line_that_differs(tmp_path):
    """A list of one PNG and one FIFO `.onnx` was read as arrays, and the PNG was blamed ("pickled data")."""
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    np.save(tmp_path / "b.npy", np.ones((1, 3, 8, 8), np.float32))
    (tmp_path / "list.txt").write_text("a.png\nb.npy\n")
    with pytest.raises(DataError, match=r"list\.txt line 2: b\.npy is not an image .* not both$"):
        load_samples(source(tmp_path / "list.txt"), [TensorSpec("x", "float32", [1, 3, 8, 8])])
