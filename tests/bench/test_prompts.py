"""The bench's --tokenizer: a file it cannot read is a clear error naming it, not a raw exception."""

import pytest

from servelab.bench.prompts import load_tokenizer
from servelab.errors import InvalidArgument


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"{bad", "key must be a string"),  # malformed JSON
        (b"\xff\xfe\x00\x01binary", "valid UTF-8"),  # not text
    ],
)
def test_an_unreadable_tokenizer_file_names_the_flag_and_the_file(tmp_path, content, reason):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    needle = f"--tokenizer '.*bad.json': not a valid tokenizer.json .*{reason}"
    with pytest.raises(InvalidArgument, match=needle) as err:
        load_tokenizer(str(path))
    assert err.value.param == "tokenizer"
