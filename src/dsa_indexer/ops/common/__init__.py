"""Code shared by the op families, one room per kind: ``runtime`` (host-side facts about the device and the
Triton interpreter that launch planning needs). Device-side pieces shared by several families live here too,
each in a module of its own; a family never imports an underscore name from another family."""
