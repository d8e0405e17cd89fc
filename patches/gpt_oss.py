"""GPT-OSS adapter: attention sinks (``s_aux``, one learned logit per head).

flash-attn 2 has no sink term, so calls carrying ``s_aux`` never go to it: flashpage's kernels
take ``s_aux`` as a keyword extension and route such calls to the exact reference (the dispatch
reason says so; ``flashpage info`` shows it). The generic attention function forwards ``s_aux``
and the sliding window GPT-OSS uses on alternating layers.
"""

from flashpage.patches.families import FamilySpec, register_family

SPEC = register_family(FamilySpec(
    "gpt_oss", "interface", True,
    "attention sinks (s_aux) forwarded; flash-attn 2 lacks them, so these calls use the reference kernel",
))
