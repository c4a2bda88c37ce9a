"""The README's example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(capsys):
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert blocks, "README has no python example"
  namespace: dict = {}
  exec(compile(blocks[0], "README.md", "exec"), namespace)
  # The example trains: its last printed loss is far below the initial log(10).
  printed = capsys.readouterr().out.strip().splitlines()
  assert "Dense_0" in "\n".join(printed)
  assert float(printed[-1]) < 0.5
