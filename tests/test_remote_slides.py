"""Remote slides (https://, http://, s3://) against real servers started here: pixels equal to the
local file's, few requests to open, failures that end the slide in one line, resume by ETag, and
no credential in any output."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from helpers.remote_servers import LatencyProxy, RangeServer, S3Server

from wsi_pipeline import cli
from wsi_pipeline.errors import RemoteReadError, SlideOpenError
from wsi_pipeline.remote.remote_file import HEAD_BYTES
from wsi_pipeline.slide import open_slide
from wsi_pipeline.slide.remote_tiff import RemoteTiffSlide

SECRET = "s3cr3t-t0ken-e2b7"
NAMES = ("svs.svs", "tiff.tiff")


@pytest.fixture(scope="module")
def slide_folder(tmp_path_factory):
    """An SVS and a JPEG-tiled TIFF (2600 x 2100 px, over 1 MiB each) in a folder of their own."""
    from wsi_pipeline.synthetic import write_synthetic_slide
    from wsi_pipeline.synthetic.storage import write_storage

    folder = tmp_path_factory.mktemp("served")
    synth = tmp_path_factory.mktemp("synth") / "synth.tiff"
    write_synthetic_slide(synth, 2600, 2100, seed=3)
    with open_slide(synth) as src:
        write_storage(src, folder / "svs.svs", "svs")
        write_storage(src, folder / "tiff.tiff", "tiff-ycbcr420")
    return folder


@pytest.fixture
def server(slide_folder):
    srv = RangeServer(str(slide_folder))
    yield srv
    srv.close()


@pytest.fixture
def s3(slide_folder, monkeypatch):
    pytest.importorskip("moto.server", reason="needs moto's S3 server: pip install 'moto[server]'")
    pytest.importorskip("boto3", reason="needs boto3: pip install 'wsi-pipeline[remote]'")
    srv = S3Server()
    client = srv.client()
    client.create_bucket(Bucket="slides")
    for name in NAMES:
        client.upload_file(str(slide_folder / name), "slides", f"cohort/{name}")
    for var, value in {
        "AWS_ENDPOINT_URL": srv.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    yield srv
    srv.close()


def _same_pixels(local_path, remote_address):
    with open_slide(local_path) as a, open_slide(remote_address) as b:
        assert isinstance(b, RemoteTiffSlide) and b.backend == a.backend == "tifffile"
        assert b.level_dimensions == a.level_dimensions and b.mpp == a.mpp
        assert b.stored_tile_format(0) == a.stored_tile_format(0)
        opened = b.remote_info()
        for level, (w, h) in enumerate(a.level_dimensions):
            assert np.array_equal(a.read_region((0, 0), level, (w, h)), b.read_region((0, 0), level, (w, h)))
        assert np.array_equal(
            a.read_region_reduced((0, 0), 0, 2, (500, 400)), b.read_region_reduced((0, 0), 0, 2, (500, 400))
        )
        tiles = [(0, 0), (3, 1), (1, 4)]
        for x, y in zip(a.raw_tiles_jpeg(0, tiles), b.raw_tiles_jpeg(0, tiles), strict=True):
            assert np.array_equal(x, y)
        return opened, b.remote_info()


@pytest.mark.parametrize("name", NAMES)
def test_an_http_slide_reads_the_local_files_pixels_in_a_few_requests(slide_folder, server, name):
    opened, read = _same_pixels(slide_folder / name, f"{server.url}/{name}")
    assert opened["size"] == os.path.getsize(slide_folder / name) > 1 << 20
    assert opened["etag"] and opened["open_requests"] <= 6
    # Every level read whole: a request per merged run of stored tiles, not one per tile.
    with open_slide(slide_folder / name) as a:
        stored = sum(a.tile_grid_shape(i)[2] * a.tile_grid_shape(i)[3] for i in range(a.level_count))
    assert read["requests"] - opened["requests"] < stored / 4


def test_an_s3_slide_reads_the_local_files_pixels(slide_folder, s3):
    opened, _ = _same_pixels(slide_folder / "svs.svs", "s3://slides/cohort/svs.svs")
    assert opened["open_requests"] <= 6 and opened["address"] == "s3://slides/cohort/svs.svs"


def test_info_json_counts_the_requests_and_bytes(server, capsys):
    assert cli.main(["info", f"{server.url}/tiff.tiff", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == f"{server.url}/tiff.tiff" and info["backend"] == "tifffile"
    remote = info["remote"]
    assert 1 <= remote["open_requests"] <= remote["requests"] and remote["open_bytes"] >= 1 << 20


def test_reads_through_added_latency_give_the_same_pixels(slide_folder, server):
    proxy = LatencyProxy(server.port, 0.01)
    try:
        _same_pixels(slide_folder / "tiff.tiff", f"http://127.0.0.1:{proxy.port}/tiff.tiff")
    finally:
        proxy.close()


def test_the_http_token_and_netrc_are_sent(slide_folder, monkeypatch, tmp_path):
    srv = RangeServer(str(slide_folder), token=SECRET)
    try:
        with pytest.raises(RemoteReadError, match=r"access refused \(401\)"):
            open_slide(f"{srv.url}/svs.svs")
        monkeypatch.setenv("WSI_PIPELINE_HTTP_TOKEN", SECRET)
        with open_slide(f"{srv.url}/svs.svs") as s:
            assert s.dimensions == (2600, 2100)
    finally:
        srv.close()
    monkeypatch.delenv("WSI_PIPELINE_HTTP_TOKEN")
    srv = RangeServer(str(slide_folder), login=("reader", SECRET))
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login reader password {SECRET}\n")
    monkeypatch.setenv("NETRC", str(netrc))
    try:
        with open_slide(f"{srv.url}/svs.svs") as s:
            assert s.dimensions == (2600, 2100)
    finally:
        srv.close()


def test_credentials_in_the_address_are_refused_without_showing_them(server):
    with pytest.raises(SlideOpenError) as err:
        open_slide(f"http://reader:{SECRET}@127.0.0.1:{server.port}/svs.svs")
    assert SECRET not in str(err.value) and "~/.netrc" in str(err.value)


def test_a_transient_failure_is_retried_and_a_lasting_one_named(server, monkeypatch):
    server.faults["svs.svs"] = "status:503:2"
    with open_slide(f"{server.url}/svs.svs") as s:
        assert s.remote_info()["open_requests"] >= 3  # two 503 answers, then the head
    server.faults["tiff.tiff"] = "status:503"
    monkeypatch.setattr("wsi_pipeline.remote.remote_file.BACKOFF_S", 0.01)
    with pytest.raises(RemoteReadError, match=r"tiff\.tiff: its first bytes .*503 \(4 tries\)"):
        open_slide(f"{server.url}/tiff.tiff")


def _run(inputs, out, capsys):
    code = cli.main(["run", *inputs, "--out", str(out), "--quiet", "--backend", "ort"])
    return code, capsys.readouterr()


def test_a_batch_of_remote_slides_fails_the_bad_ones_in_a_line_each_resumes_and_keeps_secrets(
    slide_folder, tmp_path, monkeypatch, capsys
):
    """Good, 403, 404, truncated and hanging slides in one run; then a server that dies mid-slide
    and a rerun that skips the slide already done. The token is sent to every request and appears
    in no output."""
    served = tmp_path / "served"
    shutil.copytree(slide_folder, served)
    for name in ("refused", "truncated", "hangs"):
        shutil.copy(served / "tiff.tiff", served / f"{name}.tiff")
    shutil.copy(served / "svs.svs", served / "dies.svs")
    srv = RangeServer(str(served), token=SECRET)
    srv.faults.update({"refused.tiff": "status:403", "truncated.tiff": "truncate", "hangs.tiff": "hang"})
    monkeypatch.setenv("WSI_PIPELINE_HTTP_TOKEN", SECRET)
    monkeypatch.setenv("WSI_PIPELINE_REMOTE_TIMEOUT", "0.5")
    out = tmp_path / "out"
    try:
        names = ("tiff.tiff", "refused.tiff", "missing.tiff", "truncated.tiff", "hangs.tiff")
        code, said = _run([f"{srv.url}/{n}" for n in names], out, capsys)
        assert code == 1
        manifest = json.loads((out / "manifest.json").read_text())["slides"]
        assert manifest["tiff"]["status"] == "done" and manifest["tiff"]["path"] == f"{srv.url}/tiff.tiff"
        for name, why in (("refused", "403"), ("missing", "404"), ("truncated", "truncated"), ("hangs", "no answer")):
            assert manifest[name]["status"] == "failed" and why in manifest[name]["error"], manifest[name]
            assert f"{srv.url}/{name}.tiff" in manifest[name]["error"]
        summary = json.loads((out / "slides" / "tiff" / "summary.json").read_text())
        assert summary["slide"] == f"{srv.url}/tiff.tiff" and summary["input"]["etag"]
        failed_lines = [ln for ln in said.err.splitlines() if "failed" in ln]
        assert len([ln for ln in failed_lines if ".tiff:" in ln]) >= 4 and "Traceback" not in said.err
        good_run = srv.requests["tiff.tiff"]

        # The server dies when asked for the stored tiles past the head block (the IFDs of the SVS
        # lie past them: opening it works); the slide done is skipped, its ETag asked alone.
        srv.faults["dies.svs"] = f"die-within:{HEAD_BYTES}:{2 << 20}"
        code, said2 = _run([f"{srv.url}/tiff.tiff", f"{srv.url}/dies.svs"], out, capsys)
        assert code == 1
        manifest = json.loads((out / "manifest.json").read_text())["slides"]
        assert manifest["dies"]["status"] == "failed" and "stored tile" in manifest["dies"]["error"]
        assert "done earlier" in said2.out and srv.requests["tiff.tiff"] == good_run + 1  # its ETag alone
    finally:
        srv.close()
    texts = [said.err, said.out, said2.err, said2.out]
    texts += [p.read_text(errors="replace") for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".log")]
    assert texts and not [t for t in texts if SECRET in t]


def test_pipeline_run_of_an_http_slide_finds_what_the_local_file_gives(slide_folder, server):
    from wsi_pipeline import Pipeline

    with Pipeline("nuclei_pathology", backend="ort") as pipe:
        local = pipe.run(slide_folder / "svs.svs")
        remote = pipe.run(f"{server.url}/svs.svs")
    assert len(local.detections) > 0 and np.array_equal(local.detections, remote.detections)
    assert np.array_equal(local.heatmap, remote.heatmap)
