"""What a killed batch run leaves behind is removed by the next one."""

from wsi_pipeline.batch import clean_partials


def test_partial_folders_and_a_partial_manifest_file_are_removed(tmp_path):
    (tmp_path / ".s0.partial-12-0").mkdir()
    (tmp_path / ".s0.partial-12-0" / "detections.csv").write_text("x")
    (tmp_path / ".s1.old-12-1").mkdir()
    (tmp_path / ".manifest.json.partial-12").write_text("{")  # killed while writing the manifest
    (tmp_path / "s2").mkdir()
    clean_partials(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s2"]
