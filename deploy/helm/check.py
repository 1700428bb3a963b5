#!/usr/bin/env python3
"""Schema check of the sluice Helm chart where `helm` is not installed.

Prints JSON: {"chart": Chart.yaml, "values": values.yaml, "docs": [every manifest]}.
Templates are made plain YAML by dropping lines that hold only template actions
({{- if }}, {{- end }}, {{- with }}, {{- toYaml ... }}) and replacing inline
{{ expressions }} by "TPL"; both branches of every `if` are kept, so each manifest the
chart can render is parsed. tests/deploy.rs asserts on the result; scripts/check-chart
renders the chart with a real helm and checks what it renders.
"""
import json
import pathlib
import re
import sys

import yaml

chart = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent / "sluice")
ACTION_LINE = re.compile(r"^\s*\{\{-?.*-?\}\}\s*$")
INLINE = re.compile(r"\{\{-?.*?-?\}\}")


def plain(text):
    lines = [l for l in text.splitlines() if not ACTION_LINE.match(l)]
    return "\n".join(INLINE.sub("TPL", l) for l in lines)


docs = []
for tpl in sorted((chart / "templates").glob("*.yaml")):
    for doc in yaml.safe_load_all(plain(tpl.read_text())):
        if doc is not None:
            doc["__file"] = tpl.name
            docs.append(doc)
print(json.dumps({
    "chart": yaml.safe_load((chart / "Chart.yaml").read_text()),
    "values": yaml.safe_load((chart / "values.yaml").read_text()),
    "docs": docs,
}))
