"""A Triton kernel for GPU tests of programmatic dependent launches: it lets its dependents be placed at once and
writes its output only after a long wait, so a dependent kernel that reads that output before its own
``griddepcontrol.wait`` (or lets a kernel after it do so) reads what the buffer held before."""

import functools


@functools.cache
def late_writer():
    """``late_copy_kernel[(1,)](src, dst, n, ns, BLOCK=...)``: allows its dependents at its start, spins ``ns``
    nanoseconds, then copies ``n`` elements of ``src`` into ``dst`` (``BLOCK``, a power of two, at least ``n``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def late_copy_kernel(src_ptr, dst_ptr, n, ns, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_launch_dependents()
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                       pack=1)
        t = t0
        while t - t0 < ns:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                          pack=1)
        offs = tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)

    return late_copy_kernel
