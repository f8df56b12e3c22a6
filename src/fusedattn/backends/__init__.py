"""Backends, one module each; `fusedattn.dispatch` lists them in preference order."""
