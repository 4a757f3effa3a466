"""What a killed batch run leaves behind is removed by the next one."""

from wsi_pipeline.batch.folder import clean_leftovers, slides_dir


def test_partial_folders_and_a_partial_manifest_file_are_removed(tmp_path):
    slides = slides_dir(tmp_path)
    slides.mkdir()
    (slides / ".s0.partial-12-0").mkdir()
    (slides / ".s0.partial-12-0" / "detections.csv").write_text("x")
    (slides / ".s1.old-12-1").mkdir()
    (tmp_path / ".manifest.json.partial-12").write_text("{")  # killed while writing the manifest
    (slides / "s2").mkdir()
    (tmp_path / "manifest.json").write_text("{}")
    clean_leftovers(tmp_path)
    assert sorted(p.name for p in slides.iterdir()) == ["s2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "slides"]
