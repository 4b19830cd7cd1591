"""Text columns are checked before TRL tokenizes them (issue 25, item 4): a null, NaN, non-text or empty value is one
line naming the row and column, instead of a traceback deep in TRL's preprocessing or a silent empty completion."""

import math

import pandas as pd
import pytest
from datasets import Dataset

from trl_userdp.data import check_text_columns

GOOD = {"prompt": ["Review:", ""], "chosen": [" good", " fine"], "rejected": [" bad", " poor"], "user_id": [0, 1]}


def test_text_rows_and_conversations_pass_and_an_empty_prompt_is_allowed():
    check_text_columns(Dataset.from_dict(GOOD))
    chat = [{"role": "user", "content": "Review?"}]
    check_text_columns(Dataset.from_dict({"prompt": [chat], "chosen": [[{"role": "assistant", "content": "good"}]],
                                          "rejected": [[{"role": "assistant", "content": "bad"}]]}))


@pytest.mark.parametrize("column,value,problem", [
    ("chosen", None, "no text (None)"),
    ("rejected", math.nan, "no text (None)"),  # a pandas NaN (an empty csv cell) reaches Arrow as a null
    ("prompt", None, "no text (None)"),
    ("chosen", "", "an empty string"),
    ("completion", "", "an empty string"),
])
def test_a_bad_value_is_one_line_naming_row_and_column(column, value, problem):
    data = {**GOOD, "completion": [" ok", " ok"]}
    data[column] = [data[column][0], value]
    # NaN cannot sit in an Arrow string column: from pandas (as datasets reads a csv) it becomes a null
    dataset = Dataset.from_pandas(pd.DataFrame(data)) if isinstance(value, float) else Dataset.from_dict(data)
    with pytest.raises(ValueError) as err:
        check_text_columns(dataset)
    message = str(err.value)
    assert message.startswith(f"Row 1 has {problem} in column {column!r}") and "\n" not in message


def test_a_message_without_content_is_refused():
    chat = [{"role": "assistant", "content": None}]
    with pytest.raises(ValueError, match="Row 0 has a message without text content"):
        check_text_columns(Dataset.from_dict({"chosen": [chat], "rejected": [chat]}))
