"""A few hundred mutants of small slides: each ends in success or a project error naming the file.

No case may hang (each has a limit of CPU time, and one of no progress), crash the process, allocate past
the address-space limit, or raise an exception type that is not the
project's own. The generator and the harness are in ``fuzz_slides.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from fuzz_slides import (
    aperio_mpp_slides,
    cmyk_slides,
    coarse_read_slides,
    dicom_series_slides,
    extreme_aspect_slides,
    forge_tag_layout,
    jpeg_stream_slides,
    make_base_slides,
    make_cases,
    run_case,
    run_cases,
    skewed_level_slides,
    sparse_dicom_slides,
    sparse_tiff_slides,
    special_files,
    summarize,
    tiny_tile_slides,
)

N_CASES = 500


def test_fuzzed_slides_end_in_success_or_a_project_error(tmp_path):
    cases = make_cases(tmp_path, N_CASES, seed=14)
    results = run_cases(cases, workers=2, timeout_s=30.0, mem_bytes=2 << 30)
    counts = summarize(results)
    print(f"fuzz: tried {len(results)}, " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    bad = [r for r in results if r["outcome"] not in ("success", "clean")]
    assert not bad, "\n".join(f"{r['outcome']}: {r['case']}: {r.get('detail', '')}" for r in bad[:20])
    # The mutants reach both ends: files still read, and files refused.
    assert counts["success"] >= 30 and counts["clean"] >= 100


def test_files_that_are_not_regular_are_refused_at_once_naming_what_they_are(tmp_path):
    results = run_cases(special_files(tmp_path), workers=1, timeout_s=30.0, mem_bytes=2 << 30)
    assert [r["outcome"] for r in results] == ["clean"] * len(results), results
    assert all("not a regular file" in r["detail"] for r in results), results
    assert "FIFO" in results[0]["detail"] and "socket" in results[1]["detail"], results


def _expected(cases) -> list[str]:
    """The outcome each case's description begins with ("success: ..." or "clean: ...")."""
    return [what.split(":")[0] for _, what in cases]


def test_dicom_series_among_other_files_of_their_folder_are_read_or_refused_as_expected(tmp_path):
    cases = dicom_series_slides(tmp_path)
    results = run_cases(cases, workers=1, timeout_s=60.0, mem_bytes=2 << 30)
    assert [r["outcome"] for r in results] == _expected(cases), results
    refused = [r["detail"] for r in results if r["outcome"] == "clean"]
    assert "(Secondary Capture Image Storage), not a VL Whole Slide Microscopy image" in refused[0], refused
    assert "zz.dcm is a FIFO (named pipe)" in refused[1], refused


def test_aperio_mpp_texts_are_read_and_truncated_svs_are_named_truncated(tmp_path):
    cases = aperio_mpp_slides(tmp_path)
    results = run_cases(cases, workers=1, timeout_s=30.0, mem_bytes=2 << 30)
    assert [r["outcome"] for r in results] == _expected(cases), results
    truncated = [r["detail"] for r in results if r["outcome"] == "clean"]
    assert len(truncated) == 3 and all("truncated TIFF: page" in d for d in truncated), truncated


def test_jpeg_streams_of_every_flavour_damaged_or_mixed_are_read_or_refused_as_expected(tmp_path):
    cases = jpeg_stream_slides(tmp_path)
    results = run_cases(cases, workers=2, timeout_s=60.0, mem_bytes=2 << 30)
    assert [r["outcome"] for r in results] == _expected(cases), results
    refused = [r["detail"] for r in results if r["outcome"] == "clean"]
    assert all("a 12-bit JPEG stream; expected 8-bit samples" in d for d in refused[:2]), refused
    assert "unreadable JPEG headers" in refused[2], refused


def test_slides_one_pixel_high_or_wide_are_read(tmp_path):
    results = run_cases(extreme_aspect_slides(tmp_path), workers=1, timeout_s=30.0, mem_bytes=2 << 30)
    assert [r["outcome"] for r in results] == ["success"] * len(results), results


def test_coarse_reads_skewed_pages_and_sparse_matrices_are_read_within_the_limits(tmp_path):
    """A tile 64 x coarser than a one-level slide (3.2 GB read whole), a page of another shape
    than level 0 (never read for a resolution), a sparse DICOM and a sparse TIFF claiming 400,000 px
    square (their thumbnails from their few stored tiles): read, under the harness's 2 GiB and 30 s of CPU time."""
    cases = coarse_read_slides(tmp_path / "coarse") + skewed_level_slides(tmp_path / "skewed")
    cases += sparse_dicom_slides(tmp_path / "sparse") + sparse_tiff_slides(tmp_path / "sparse_tiff")
    results = run_cases(cases, workers=1, timeout_s=30.0, mem_bytes=2 << 30)
    assert [r["outcome"] for r in results] == ["success"] * len(results), results


def test_levels_of_tiny_tiles_are_refused_at_once_naming_the_tile_size(tmp_path):
    results = run_cases(tiny_tile_slides(tmp_path), workers=1, timeout_s=30.0, mem_bytes=2 << 30)
    assert [r["outcome"] for r in results] == ["clean"] * len(results), results
    assert "1x1 px tiles" in results[0]["detail"] and "8x8 px tiles" in results[1]["detail"], results


@pytest.mark.parametrize(
    ("tag", "how", "message"),
    [
        (259, "empty", "tag Compression (259): expected one integer, found ()"),
        (323, "undefined", "tag TileLength (323): expected one integer, found b'\\x80'"),
        (258, "mixed", "tag BitsPerSample (258): expected the same integer for every sample, found (8, 8, 16)"),
    ],
)
def test_a_tag_of_a_forged_shape_is_named_not_a_bare_type_error(tmp_path, tag, how, message):
    base = make_base_slides(tmp_path / "bases")["jpeg.tiff"]
    buf = bytearray(base.read_bytes())
    forge_tag_layout(buf, tag, how)
    path = tmp_path / "forged.tiff"
    path.write_bytes(bytes(buf))
    result = run_case(str(path))
    assert result["outcome"] == "clean" and message in result["detail"], result


def test_cmyk_is_read_as_rgb_by_openslide_or_refused_never_shown_as_inks(tmp_path):
    from wsi_pipeline.errors import SlideOpenError
    from wsi_pipeline.slide import open_slide

    (tiled, _), (strips, _) = cmyk_slides(tmp_path)
    with open_slide(tiled) as slide:  # auto: OpenSlide, which converts the inks
        assert slide.backend == "openslide"
        np.testing.assert_array_equal(slide.read_region((0, 0), 0, (2, 2))[0, 0], [55, 255, 255])
    for path, backend in ((tiled, "tifffile"), (strips, "auto"), (strips, "image")):
        with pytest.raises(SlideOpenError, match=r"CMYK \(photometric SEPARATED\) is not RGB"):
            open_slide(path, backend)


def test_the_harness_limits_cpu_time_not_the_wall_clock():
    """A process that sleeps uses no CPU time, so a machine busy with other work cannot make a case
    look hung; one that spins uses it, its children's included."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from fuzz_slides import cpu_seconds

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])"],
        start_new_session=True,  # its child too ends with its group
    )
    try:
        time.sleep(1.5)
        assert cpu_seconds(sleeper.pid) < 0.5
        assert cpu_seconds(spinner.pid) > 0.3  # its child's spinning
    finally:
        sleeper.kill()
        os.killpg(spinner.pid, signal.SIGKILL)
        for p in (sleeper, spinner):
            p.wait()
