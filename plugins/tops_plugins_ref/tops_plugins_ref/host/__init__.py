"""The reference computation as it runs inside the host callback: NumPy in float64, and nothing of JAX.

A host callback that calls back into JAX can deadlock: the runtime that is waiting for the
callback to return is the one the callback would need (see the plugin README). So no module of
this package imports jax, jaxlib or tops_core; the plugin's tests check both that and, at run
time, that the callback executes no JAX code.
"""
