"""``epmoe run``'s messages for bad prompts and tokenizers, the float32 judge of bf16 runs, and saved loads."""

from __future__ import annotations

import shutil

import pytest

from epmoe.cli import main


@pytest.fixture(scope="module")
def kimi(tiny_checkpoints):
    return tiny_checkpoints("kimi-k2.5")


def test_a_prompt_that_is_not_utf8_is_named(kimi, capsys):
    prompt = b"caf\xc3\xa9 \xe9t\xe9".decode("utf-8", "surrogateescape")  # how Python hands over non-UTF-8 argv
    assert main(["run", "--model", str(kimi), "--prompt", "fine", "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert ("epmoe run: error: --prompt b'caf\\xc3\\xa9 \\xe9t\\xe9' is not valid UTF-8 text (byte 0xe9 at "
            "position 6); pass prompts in UTF-8") in err


def test_encoding_text_that_is_not_unicode_names_it(kimi):
    from epmoe.engine.engine import encode_text, load_tokenizer

    with pytest.raises(ValueError, match=r"prompt 'ab\\udce9' is not valid UTF-8 text \(position 2\)"):
        encode_text(load_tokenizer(str(kimi)), 512, "ab\udce9")
    with pytest.raises(ValueError, match=r"prompt 'ab\\udce9' is not valid UTF-8 text \(position 2\)"):
        encode_text(None, 512, "ab\udce9")


def test_a_corrupt_tokenizer_file_is_named(kimi, tmp_path, capsys):
    broken = tmp_path / "ckpt"
    shutil.copytree(kimi, broken)
    (broken / "tokenizer.json").write_text("")
    assert main(["run", "--model", str(broken), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert (f"epmoe run: error: tokenizer file '{broken}/tokenizer.json' cannot be read: Expecting value: line 1 "
            "column 1 (char 0)") in err
