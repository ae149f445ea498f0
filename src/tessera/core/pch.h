// Precompiled header for the library and the programs that reuse it: the heavy,
// stable libtorch headers only. Never include this from a Tessera header.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include <map>
#include <memory>
