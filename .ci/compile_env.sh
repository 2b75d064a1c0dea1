#!/usr/bin/env bash
# Placeholder replaced by the kernel work: installs libtpu + the jax CUDA plugin into .compile-env/
exit 0
