"""A model is input, and input can be hostile: what a folder or GGUF is refused for before anything
runs (each a ModelSourceError naming the file and what is wrong; the CLI exits 2).

- **Remote code.** A config.json or tokenizer_config.json with ``auto_map`` asks transformers to
  import Python files shipped with the model. It never runs unless the recipe's ``model:`` says
  ``trust_remote_code: true`` (and then every run says so).
- **Pickled weights** (``pytorch_model.bin``, ``*.pt``, ``*.pth``): a pickle can call any Python
  function while it loads. transformers loads them with torch's weights-only unpickler; a file
  whose pickle names a function outside that loader's allowlist
  (``torch.serialization.get_unsafe_globals_in_checkpoint``, which reads the pickle without running
  it) is refused here, naming the functions.
- **Damaged or truncated weights.** A safetensors file whose tensors do not tile its data (a
  truncated download, an offset past the end, a dtype and shape that do not match their bytes), a
  GGUF whose header puts a tensor past the end of the file or names an unknown type.
- **A chat template that leaves Jinja's sandbox or does not finish.** Templates are rendered in
  Jinja's sandbox (transformers' renderer). Before a run, the model's template is rendered once on a
  probe conversation in a child process with a time and memory limit: an attribute the sandbox
  forbids, a loop that does not end, or output that grows without bound is refused with the reason.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from ..core.errors import ModelSourceError
from .model_headers import GGUFHeader, safetensors_header

__all__ = ["check_gguf_layout", "check_pickles", "check_remote_code", "check_safetensors", "check_template", "model_templates"]

# Bytes per element of each safetensors dtype (the format's own list).
_ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_PICKLES = ("pytorch_model*.bin", "*.pt", "*.pth")
_TEMPLATE_TIMEOUT_S = 10.0  # a real template renders a probe conversation in milliseconds
_TEMPLATE_MEMORY = 1 << 30  # bytes the child may map: far above any template's output


def check_remote_code(folder: Path, *, trust: bool) -> None:
    """Refuse a folder that asks to run its own Python code, unless ``trust``."""
    for name in ("config.json", "tokenizer_config.json"):
        path = folder / name
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # read_config names a broken config.json; a broken tokenizer config fails its own load
        code = data.get("auto_map") if isinstance(data, dict) else None
        if code and not trust:
            msg = (f"model: {str(path)!r} asks to run the model folder's own Python code (auto_map: {json.dumps(code)[:160]}); fractal_opt "
                   "never runs it unless the recipe says so: model: {source: ..., trust_remote_code: true} (read that code first)")
            raise ModelSourceError(msg)


def check_pickles(folder: Path) -> None:
    """Refuse pickled weights whose pickle names a function torch's weights-only loader does not allow."""
    for path in sorted({p for pattern in _PICKLES for p in folder.glob(pattern)}):
        import torch.serialization

        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception as e:  # noqa: BLE001 (a damaged zip or pickle: torch raises many kinds)
            raise ModelSourceError(f"model: {str(path)!r} is not a readable PyTorch checkpoint ({type(e).__name__}: {e}); re-download it.") from None
        if unsafe:
            msg = (f"model: {str(path)!r} is a pickle that would call {', '.join(sorted(unsafe)[:5])} while loading, which torch's weights-only "
                   "loader refuses; pickled weights are loaded only with that loader. Use the model's safetensors files instead")
            raise ModelSourceError(msg)


def check_safetensors(path: Path) -> None:
    """Refuse a safetensors file whose tensors do not tile its data exactly (truncated or damaged)."""
    header = safetensors_header(path)
    size = path.stat().st_size
    data = size - 8 - int.from_bytes(path.open("rb").read(8), "little")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        problem = _tensor_problem(info, data)
        if problem:
            raise ModelSourceError(f"model: weights file {str(path)!r}: tensor {name!r} {problem}; the file is damaged or truncated, re-download it.")
        end = max(end, info["data_offsets"][1])
    if end != data:
        raise ModelSourceError(f"model: weights file {str(path)!r} holds {data} bytes of tensor data and its header describes {end}; "
                               "the file is truncated or damaged, re-download it.")


def _tensor_problem(info: object, data: int) -> str | None:
    if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or not isinstance(info.get("data_offsets"), list) or len(info["data_offsets"]) != 2:
        return "has no dtype, shape and data_offsets"
    dtype, shape, (begin, end) = info.get("dtype"), info["shape"], info["data_offsets"]
    if dtype not in _ST_BYTES or not all(isinstance(d, int) and d >= 0 for d in shape) or not all(isinstance(o, int) for o in (begin, end)):
        return f"has dtype {dtype!r} and shape {shape!r}, which safetensors does not define"
    if not 0 <= begin <= end <= data:
        return f"lies at bytes {begin}..{end} of {data}"
    if (end - begin) != math.prod(shape) * _ST_BYTES[dtype]:
        return f"is {dtype} {shape} ({math.prod(shape) * _ST_BYTES[dtype]} bytes) but spans {end - begin} bytes"
    return None


def check_gguf_layout(path: Path, header: GGUFHeader) -> None:
    """Refuse a GGUF whose header names an unknown type or puts a tensor past the end of the file."""
    size = path.stat().st_size
    for t in header.tensors:
        try:
            n_bytes = t.n_bytes
        except (ValueError, KeyError):
            raise ModelSourceError(f"model: {str(path)!r}: tensor {t.name!r} has ggml type {t.type_id}, which llama.cpp does not define; the file is damaged.") from None
        end = header.data_start + t.offset + n_bytes
        if end > size:
            raise ModelSourceError(f"model: {str(path)!r}: its header puts tensor {t.name!r} at bytes {header.data_start + t.offset}..{end}, "
                                   f"past the end of the {size}-byte file; it is truncated or its header lies, re-download it.")


def model_templates(folder: Path) -> list[tuple[str, str]]:
    """The chat templates a model folder ships: (where, template) for chat_template.jinja and
    tokenizer_config.json's ``chat_template`` (a string, or a list of named templates)."""
    out = []
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        out.append((str(jinja), jinja.read_text(encoding="utf-8", errors="replace")))
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        config = {}
    value = config.get("chat_template") if isinstance(config, dict) else None
    where = str(folder / "tokenizer_config.json")
    if isinstance(value, str):
        out.append((where, value))
    elif isinstance(value, list):
        out += [(f"{where} ({item.get('name')})", item["template"]) for item in value if isinstance(item, dict) and isinstance(item.get("template"), str)]
    return out


def check_template(template: str, *, where: str) -> None:
    """Render ``template`` once on a probe conversation in Jinja's sandbox, in a child process with
    a time and memory limit; refuse it if it leaves the sandbox, loops or grows without bound."""
    problem = _template_problem(template)
    if problem:
        raise ModelSourceError(f"model: the chat template in {where} {problem}; fractal_opt renders templates only in Jinja's sandbox, within limits")


@lru_cache(maxsize=64)
def _template_problem(template: str) -> str | None:
    try:
        done = subprocess.run([sys.executable, "-c", _RENDER], input=template, capture_output=True, text=True, timeout=_TEMPLATE_TIMEOUT_S,
                              env={**os.environ, "FRACTAL_OPT_TEMPLATE_MEMORY": str(_TEMPLATE_MEMORY)}, check=False)
    except subprocess.TimeoutExpired:
        return f"did not finish rendering a two-message conversation in {_TEMPLATE_TIMEOUT_S:.0f} s (a loop that does not end)"
    if done.returncode == 0:
        return None
    tail = (done.stderr.strip().splitlines() or ["(no message)"])[-1][:300]
    if "SecurityError" in tail:
        return f"tries to leave Jinja's sandbox ({tail})"
    if "MemoryError" in tail or done.returncode < 0:
        return f"grew past {_TEMPLATE_MEMORY >> 20} MB rendering a two-message conversation"
    return f"fails to render a conversation ({tail})"


# The child: Jinja's immutable sandbox with transformers' settings for chat templates (trim and
# lstrip blocks, the loop-control extension, tojson, raise_exception), under an address-space limit.
_RENDER = r"""
import os, resource, sys
limit = int(os.environ["FRACTAL_OPT_TEMPLATE_MEMORY"])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import json
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
def raise_exception(message):
    raise ValueError(message)
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **{k: v for k, v in kw.items() if k == "indent"})
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = lambda fmt: "2026-01-01"
template = env.from_string(sys.stdin.read())
user = {"role": "user", "content": "What is the capital of France?"}
for messages in ([{"role": "system", "content": "You are helpful."}, user], [user]):
    try:
        text = template.render(messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    except ValueError:  # the template's own rule (raise_exception: "system role not supported"): try without a system turn
        continue
    if len(text) > 10_000_000:
        raise MemoryError("the rendered prompt is over 10 MB")
    break
"""
