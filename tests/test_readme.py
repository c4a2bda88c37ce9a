"""The README's examples run as written (in order, as one session on 8 devices)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run(capsys):
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert len(blocks) >= 2, "README should show a single-device and a distributed example"
  namespace: dict = {}
  for i, block in enumerate(blocks):
    exec(compile(block, f"README.md example {i}", "exec"), namespace)
    printed = capsys.readouterr().out.strip().splitlines()
    # Each example trains: its last printed loss is far below the initial log(10).
    assert float(printed[-1]) < 0.5, (i, printed[-1])
    if i == 0:
      assert "Dense_0" in "\n".join(printed)
