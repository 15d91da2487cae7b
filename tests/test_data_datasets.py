"""Datasets: schema checks, row validation into error rows, reading files / directories / URIs."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from components.data.datasets import (
    DatasetError,
    Job,
    jobs_from_table,
    jobs_to_table,
    parse_size,
    read_dataset,
    shard_ranges,
    split_into_shards,
    validate_dataset,
    validate_rows,
)
from components.data.sample import write_sample_edit_dataset, write_sample_generate_dataset


def png(color=(200, 30, 30), size=(32, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def write(path, rows, schema=None) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def test_bad_rows_become_error_rows_naming_the_problem(tmp_path) -> None:
    good = png()
    corrupt = good[: len(good) // 2]  # a truncated PNG: header fine, pixels missing
    rows = [
        {"id": "ok-1", "instruction": "make the sky purple", "image": good, "size": "auto"},
        {"id": "corrupt", "instruction": "make it blue", "image": corrupt, "size": "auto"},
        {"id": "no-instr", "instruction": None, "image": good, "size": "auto"},
        {"id": "long", "instruction": "x" * 300, "image": good, "size": "auto"},
        {"id": "badsize", "instruction": "crop it", "image": good, "size": "1000x999"},
        {"id": "ok-2", "instruction": "add a hat", "image": good, "size": "512x768"},
    ]
    path = write(tmp_path / "ds.parquet", rows)
    valid, errors = validate_dataset(read_dataset(path), "edit", max_prompt_tokens=100)

    assert [j.id for j in valid] == ["ok-1", "ok-2"]
    by_id = {j.id: j.error for j in errors}
    assert set(by_id) == {"corrupt", "no-instr", "long", "badsize"}
    assert "image is not a decodable image" in by_id["corrupt"]
    assert by_id["no-instr"] == "instruction is missing or empty"
    assert by_id["long"] == "instruction is 300 tokens, over the budget of 100"
    assert by_id["badsize"] == "size '1000x999' is not supported"
    assert all(j.ok for j in valid) and not any(j.ok for j in errors)
    # Every input row lands in exactly one list, with its original position.
    assert sorted(j.row_index for j in valid + errors) == list(range(len(rows)))
    assert valid[1].size_wh() == (512, 768) and valid[0].size_wh() is None
    assert valid[0].image == good


def test_custom_token_counter_and_size_rule() -> None:
    rows = [{"id": "a", "prompt": "one two three"},
            {"id": "b", "prompt": "one two three four", "size": "64x64"},
            {"id": "c", "prompt": "one two", "size": "128x128"}]
    valid, errors = validate_rows(rows, "generate", count_tokens=lambda s: len(s.split()), max_prompt_tokens=3,
                                  is_supported_size=lambda w, h: w == h == 64)
    assert [j.id for j in valid] == ["a"]
    assert [(j.id, j.error) for j in errors] == [("b", "prompt is 4 tokens, over the budget of 3"),
                                                 ("c", "size '128x128' is not supported")]
    # The default rule (multiples of 16, 64..4096) accepts 128x128; no budget -> no token check.
    valid, errors = validate_rows(rows, "generate", max_prompt_tokens=None)
    assert [j.id for j in valid] == ["a", "b", "c"] and errors == []


def test_duplicate_and_empty_ids() -> None:
    rows = [{"id": "x", "prompt": "p"}, {"id": "y", "prompt": "p"}, {"id": "x", "prompt": "p"},
            {"id": "", "prompt": "p"}, {"id": None, "prompt": "p"}]
    valid, errors = validate_rows(rows, "generate")
    assert [j.id for j in valid] == ["x", "y"]
    assert [(j.row_index, j.error) for j in errors] == [
        (2, "duplicate id 'x' (first used by row 0)"),
        (3, "id is missing or empty"),
        (4, "id is missing or empty"),
    ]


def test_a_row_without_an_id_is_not_named_like_a_real_row(tmp_path) -> None:
    """Its error row was named row-000001, beside a real row-000001 (one record for two rows)."""
    path = write(tmp_path / "ids.parquet", [{"id": "row-000001", "prompt": "p"}, {"id": "", "prompt": "q"},
                                            {"id": "(empty id: row 1)", "prompt": "r"}])
    valid, errors = validate_dataset(read_dataset(str(path)), "generate")
    assert [j.id for j in valid] == ["row-000001"]
    assert [(j.id, j.row_index, j.error) for j in errors] == [
        ("(empty id: row 1)", 1, "id is missing or empty"),
        ("(empty id: row 1)", 2, "duplicate id '(empty id: row 1)' (first used by row 1)")]
    from components.data.runs import row_key

    assert row_key(valid[0].id) != row_key(errors[0].id)


def test_missing_id_column_derives_ids_from_position(tmp_path) -> None:
    a = write(tmp_path / "d" / "a.parquet", [{"prompt": "one"}, {"prompt": "two"}])
    write(tmp_path / "d" / "b.parquet", [{"prompt": "three"}])
    valid, errors = validate_dataset(read_dataset(str(tmp_path / "d")), "generate")
    assert errors == []
    assert [(j.id, j.text) for j in valid] == [("row-000000", "one"), ("row-000001", "two"), ("row-000002", "three")]
    # the same file read again gives the same ids
    assert [j.id for j in validate_dataset(read_dataset(a), "generate")[0]] == ["row-000000", "row-000001"]


def test_image_uri_local_relative_and_missing(tmp_path) -> None:
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png((0, 255, 0)))
    abs_path = tmp_path / "abs.png"
    abs_path.write_bytes(png((0, 0, 255)))
    rows = [
        {"id": "rel", "instruction": "i", "image_uri": "imgs/a.png"},
        {"id": "abs", "instruction": "i", "image_uri": str(abs_path)},
        {"id": "fileuri", "instruction": "i", "image_uri": f"file://{abs_path}"},
        {"id": "gone", "instruction": "i", "image_uri": "imgs/nope.png"},
        {"id": "none", "instruction": "i", "image_uri": None},
    ]
    valid, errors = validate_dataset(read_dataset(write(tmp_path / "ds.parquet", rows)), "edit")
    assert [j.id for j in valid] == ["rel", "abs", "fileuri"]
    assert Image.open(io.BytesIO(valid[0].image)).getpixel((0, 0)) == (0, 255, 0)
    assert valid[0].pil_images()[0].size == (32, 24)
    errs = {j.id: j.error for j in errors}
    assert errs["gone"] == "image_uri 'imgs/nope.png' does not exist"
    assert errs["none"] == "image is missing or empty"


def test_reference_image_and_hf_image_struct() -> None:
    rows = [
        {"id": "a", "instruction": "i", "image": {"bytes": png(), "path": "a.png"}, "reference_image": png((1, 2, 3))},
        {"id": "b", "instruction": "i", "image": {"bytes": png(), "path": None}, "reference_image": b"not an image"},
    ]
    valid, errors = validate_rows(rows, "edit")
    assert [j.id for j in valid] == ["a"] and len(valid[0].pil_images()) == 2
    assert errors[0].id == "b" and "reference_image is not a decodable image" in errors[0].error


def test_several_problems_in_one_row_are_all_named() -> None:
    (job,) = validate_rows([{"id": "z", "instruction": " ", "image": b"junk", "size": "huge", "seed": -1}],
                           "edit")[1]
    assert "instruction is missing or empty" in job.error
    assert "image is not a decodable image" in job.error
    assert "size 'huge' is not 'auto' or 'WIDTHxHEIGHT'" in job.error
    assert "seed -1 is not an integer" in job.error


def test_dataset_level_errors_are_clear(tmp_path) -> None:
    with pytest.raises(DatasetError, match="no 'instruction' column"):
        validate_dataset(read_dataset(write(tmp_path / "a.parquet", [{"id": "1", "prompt": "p"}])), "edit")
    with pytest.raises(DatasetError, match="needs an 'image' or 'image_uri' column"):
        validate_dataset(read_dataset(write(tmp_path / "b.parquet", [{"id": "1", "instruction": "p"}])), "edit")
    with pytest.raises(DatasetError, match="no \\*.parquet files"):
        read_dataset(str(tmp_path / "empty_dir"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        read_dataset(str(tmp_path / "junk.parquet"))
    with pytest.raises(DatasetError, match="unknown dataset kind"):
        validate_dataset(read_dataset(write(tmp_path / "c.parquet", [{"id": "1", "prompt": "p"}])), "video")


def test_fingerprint_changes_with_content(tmp_path) -> None:
    path = write(tmp_path / "x.parquet", [{"id": "1", "prompt": "p"}])
    fp1 = read_dataset(path).fingerprint
    assert read_dataset(path).fingerprint == fp1
    write(tmp_path / "x.parquet", [{"id": "1", "prompt": "q"}])
    assert read_dataset(path).fingerprint != fp1


def test_sample_datasets_are_valid_and_deterministic(tmp_path) -> None:
    uri = write_sample_edit_dataset(str(tmp_path / "edit"), n=6, size=64, seed=3)
    assert uri.endswith("edit/edit.parquet")
    valid, errors = validate_dataset(read_dataset(uri), "edit")
    assert len(valid) == 6 and errors == []
    assert {Image.open(io.BytesIO(j.image)).size for j in valid} == {(64, 64)}
    assert len({j.image for j in valid}) == 6  # six different pictures
    again = write_sample_edit_dataset(str(tmp_path / "edit2.parquet"), n=6, size=64, seed=3)
    assert read_dataset(again).read_table().equals(read_dataset(uri).read_table())
    gen = write_sample_generate_dataset(str(tmp_path / "gen"), n=4)
    valid, errors = validate_dataset(read_dataset(gen), "generate")
    assert [j.id for j in valid] == ["gen-0000", "gen-0001", "gen-0002", "gen-0003"] and errors == []


def test_shard_ranges_cover_every_row_once() -> None:
    for n in (0, 1, 5, 17, 100):
        for k in (1, 2, 3, 8, 20):
            ranges = shard_ranges(n, k)
            covered = [i for a, b in ranges for i in range(a, b)]
            assert covered == list(range(n))
            sizes = [b - a for a, b in ranges]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="num_shards must be >= 1, got 0"):
        shard_ranges(3, 0)


def test_split_keeps_error_rows_in_place_and_round_trips() -> None:
    rows = [{"id": f"r{i}", "prompt": "p" if i % 3 else ""} for i in range(10)]
    valid, errors = validate_rows(rows, "generate")
    shards = split_into_shards(errors + valid, 3)  # order of the lists does not matter
    assert [[j.row_index for j in s] for s in shards] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    back = [jobs_from_table(jobs_to_table(s)) for s in shards]
    assert back == shards
    assert isinstance(back[0][0], Job) and back[0][0].error == "prompt is missing or empty"


def test_parse_size_and_effective_seed() -> None:
    assert parse_size("auto") is None and parse_size(None) is None
    assert parse_size("1024x768") == (1024, 768) and parse_size(" 64 X 32 ") == (64, 32)
    for bad in ("1024", "0x5", "axb", "-4x4"):
        with pytest.raises(ValueError, match="is not 'auto' or 'WIDTHxHEIGHT'|has a zero dimension"):
            parse_size(bad)
    job = Job(id="a", row_index=0, kind="generate", text="p")
    assert job.effective_seed() == job.effective_seed() != job.effective_seed(base_seed=1)
    assert Job(id="a", row_index=0, kind="generate", text="p", seed=7).effective_seed() == 7
