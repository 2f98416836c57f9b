//! The agent's heap on glibc. Every [`Netns::run`](crate::netns::Netns::run) is a fresh thread,
//! and glibc gives threads malloc arenas of their own (up to eight per core) that keep whatever
//! was freed in them. An agent doing namespace work for hundreds of pods, several at a time, ends
//! up holding megabytes of free memory spread over idle arenas. musl's allocator has no
//! per-thread arenas and returns freed pages itself, so there is nothing to do there.

/// Caps the number of arenas. Call first thing in `main`, before any other thread exists.
pub fn limit_arenas(max: i32) {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets an allocator parameter; no other thread is allocating yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, max);
    }
    #[cfg(not(target_env = "gnu"))]
    let _ = max;
}

/// Hands free memory in every arena back to the kernel (after bursts of pod operations).
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes the allocator's own locks and touches only free chunks.
    unsafe {
        libc::malloc_trim(0);
    }
}
