"""What tracing says when the user's code fails: the module running (`NameStack`) and the
user's source line, in the failure's own exception type where it can be rebuilt (`same_kind`).
The stage programs name a traced node's module and line the same way (`node_location`).
"""

from __future__ import annotations

import os
import re
import traceback

import torch
from torch import fx, nn

from zbcompile import _torch_internals as ti


class NameStack:
    """A read-only view of the module stack, snapshotted when an error escapes; `in_loss_fn` is
    set once the model's forward has returned."""

    def __init__(self, stack: list, root: nn.Module) -> None:
        self._stack = stack
        self._root = root
        self.in_loss_fn = False

    def current(self) -> str:
        return self._stack[-1][0] if self._stack else "<root>"

    def where(self) -> str:
        """The innermost module running, with its class, or loss_fn."""
        if not self._stack and self.in_loss_fn:
            return "loss_fn"
        module = self._stack[-1][2] if self._stack else self._root
        return f"module '{self.current()}' ({type(module).__name__})"


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(__file__))


def user_frame(error: BaseException) -> str:
    """'file:line: code' of the innermost frame outside torch and zbcompile."""
    return _innermost_user_frame(traceback.extract_tb(error.__traceback__)) or "<unknown source line>"


def _innermost_user_frame(frames: traceback.StackSummary) -> str | None:
    mine = [f for f in frames if not f.filename.startswith((_TORCH_DIR, _OWN_DIR)) and "functorch" not in f.filename]
    return f"{mine[-1].filename}:{mine[-1].lineno}: {mine[-1].line}" if mine else None


_STACK_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def source_line(node: fx.Node) -> str | None:
    """'file:line: code' of the user's code that created a traced node (from its recorded stack)."""
    frames = [
        traceback.FrameSummary(file, int(line), name, line=code.strip())
        for file, line, name, code in _STACK_FRAME.findall(node.meta.get("stack_trace") or "")
    ]
    return _innermost_user_frame(traceback.StackSummary.from_list(frames))


def node_location(node: fx.Node) -> str:
    """"module '<fqn>' (<file>:<line>: <code>)": where the user's code created a traced node."""
    module = node.meta.get("custom", {}).get("module", "<root>")
    return f"module '{module}' ({source_line(node) or 'unknown source line'})"


def raised_here(error: BaseException) -> bool:
    """Whether zbcompile raised `error` itself (a refusal that names its culprit already)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_OWN_DIR)


def traced_error(module_stack: NameStack, error: Exception) -> Exception:
    """What tracing raises for `error`, naming the module (or loss_fn) and the source line."""
    if isinstance(error, ti.DATA_DEPENDENT_ERRORS):
        return ValueError(_data_dependent_message(module_stack, error))
    if isinstance(error, RuntimeError) and any(sign in str(error) for sign in _UNTRACEABLE_AUTOGRAD):
        return ValueError(_untraceable_autograd_message(module_stack, error))
    message = (
        f"zbcompile could not trace {module_stack.where()} at {user_frame(error)}: {type(error).__name__}: "
        f"{first_line(error)}{_DEBUG_HINT}"
    )
    return same_kind(error, message)


def same_kind(error: Exception, message: str) -> Exception:
    """An exception of `error`'s type carrying `message`, or a RuntimeError where that type cannot
    be built from a message alone."""
    try:
        rebuilt = type(error)(message)
    except Exception:  # noqa: BLE001 - a type with another constructor
        return RuntimeError(message)
    return rebuilt if str(rebuilt) == message else RuntimeError(message)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


_DEBUG_HINT = f" (set {ti.DEBUG_ENV}=1 to see torch's own log of the failure)"


def _data_dependent_message(module_stack: NameStack, error: BaseException) -> str:
    return (
        f"zbcompile cannot trace data-dependent control flow in {module_stack.where()} "
        f"at {user_frame(error)}. The branch depends on tensor values, which are unknown while "
        "tracing. Rewrite it with tensor ops (torch.where, masking) or move it out of the model's "
        "forward; in a library's model, look for an argument that avoids that code (e.g. compute the loss "
        f"from the logits in a loss_fn instead of passing labels). (torch said: {first_line(error)})"
    )


# What torch raises when the forward uses autograd in a way functionalize-and-trace cannot follow:
# a custom torch.autograd.Function (old or new style), torch.autograd.grad or requires_grad_()
# in the forward, an in-place update of a parameter.
_UNTRACEABLE_AUTOGRAD = (
    "autograd.Function with functorch transforms",
    "Functionalize rule for custom_function_call",
    "inside of a function being transformed by a functorch transform",
    "a leaf Variable that requires grad is being used in an in-place operation",
    "does not require grad and does not have a grad_fn",  # torch.autograd.grad on a traced value
)


def _untraceable_autograd_message(module_stack: NameStack, error: BaseException) -> str:
    return (
        f"zbcompile cannot trace the autograd use in {module_stack.where()} at {user_frame(error)}: "
        "each stage's backward is derived from the traced forward ops, so a custom torch.autograd.Function's "
        "backward, torch.autograd.grad or requires_grad_() inside the forward, or an in-place update of a "
        f"parameter cannot be reproduced. Express the forward with differentiable torch ops and keep parameter "
        f"updates out of it. (torch said: {first_line(error)})"
    )
