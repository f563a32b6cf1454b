"""Names of the values in a stage's per-microbatch environment: every graph the compiler
produces reads and returns values named `<prefix><what>` (`program.Signature`).

    param:<fqn>, buffer:<fqn>   the model's own parameters and buffers
    in:<value>                  a stage input (boundary value, model input or target)
    out:<value>                 a stage output (boundary value; `out:loss` on the last stage)
    update:<fqn>                the new value of a buffer the forward updates (written into the
                                buffer after F; no gradient; the backward reads it in the
                                buffer's place)
    tangent:<value>             the gradient of a stage output, from downstream (`tangent:loss`)
    grad:<value>                the gradient of a stage input, sent upstream
    grad:param:<fqn>            a parameter's gradient
    saved:<node>                an activation F keeps for the backward
    stash:<node>                a value the input-gradient graph I keeps for W

Example (stage 1 of a two-layer MLP):

    F:        (param:fc2.weight, param:fc2.bias, in:relu, in:target_0) -> (out:loss, saved:relu, ...)
    backward: (param:fc2.weight, saved:..., tangent:loss) -> (grad:relu, grad:param:fc2.weight, ...)

The `torch.compile` backend names a region's values the same way, by position (`param:3`).
"""

from __future__ import annotations

PARAM = "param:"
BUFFER = "buffer:"
INPUT = "in:"
OUTPUT = "out:"
UPDATE = "update:"
TANGENT = "tangent:"
GRAD = "grad:"
PARAM_GRAD = GRAD + PARAM
SAVED = "saved:"
STASH = "stash:"

STATE = (PARAM, BUFFER)  # the model's own values: the runtime's state, never in an environment


def param_name(fqn: object) -> str:
    return f"{PARAM}{fqn}"


def buffer_name(fqn: object) -> str:
    return f"{BUFFER}{fqn}"


def input_name(value: str) -> str:
    return f"{INPUT}{value}"


def output_name(value: str) -> str:
    return f"{OUTPUT}{value}"


def update_name(fqn: str) -> str:
    return f"{UPDATE}{fqn}"


def tangent_name(value: object) -> str:
    return f"{TANGENT}{value}"


def grad_name(value: object) -> str:
    """The gradient of a stage input (or of a region's input, by position)."""
    return f"{GRAD}{value}"


def param_grad_name(fqn: object) -> str:
    return f"{PARAM_GRAD}{fqn}"


def saved_name(node: str) -> str:
    return f"{SAVED}{node}"


def stash_name(node: str) -> str:
    return f"{STASH}{node}"


def is_state(name: str) -> bool:
    """A parameter or a buffer."""
    return name.startswith(STATE)


def is_param_grad(name: str) -> bool:
    return name.startswith(PARAM_GRAD)


def is_input_grad(name: str) -> bool:
    """The gradient of an input (`grad:<value>`), not of a parameter."""
    return name.startswith(GRAD) and not is_param_grad(name)


def is_stash(name: str) -> bool:
    return name.startswith(STASH)


def fqn_of(name: str) -> str:
    """What a name names, without its prefix: `param:fc.weight` and `grad:param:fc.weight` ->
    `fc.weight`, `grad:x` -> `x`, `tangent:loss` -> `loss`."""
    for prefix in (PARAM_GRAD, PARAM, BUFFER, INPUT, OUTPUT, UPDATE, TANGENT, GRAD, SAVED, STASH):
        if name.startswith(prefix):
            return name[len(prefix) :]
    raise ValueError(f"{name!r} is not a value name (no known prefix)")
