"""Reading a caller's jit trace: what the drop-ins learn of a mask from the equations
that made it.

* `folding`: the value of an array computed from constants alone (Flax's
  ``make_causal_mask`` inside jit), evaluated on the host at trace time.
* `mask_program`: a mask computed elementwise from arrays read per query row or per
  key column and from positions (Flax's padding and document masks), as a mask_mod
  over those arrays.

Both walk the trace through `walk`, which reads JAX's tracing internals; where those
differ the answer is None and the mask is used as it is.
"""
