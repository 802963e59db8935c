/// @file
/// The core and the RPC layer of corpc (C++20 coroutine RPC for libtorch) in one include.
///
/// The upper layers have their own headers, so that a program pays (in build time) only for what it uses:
/// ```
///   corpc/rref/rref.hpp               RRef<T>, remote(), proxies
///   corpc/rref/remote_module.hpp      RemoteModule<M>               (torch::nn)
///   corpc/autograd/dist_autograd.hpp  dist_autograd::Context, backward, get_gradients
///   corpc/autograd/optimizer.hpp      DistributedOptimizer<Opt>     (torch::optim)
///   corpc/pipeline/pipeline.hpp       pipeline::Pipeline (schedules, balancing, timeline)
///   corpc/ddp/ddp.hpp                 ddp::DistributedDataParallel  (library corpc_ddp; c10d)
/// ```
#pragma once

#include "corpc/core/future.hpp"
#include "corpc/core/scope.hpp"
#include "corpc/core/sync_wait.hpp"
#include "corpc/core/task.hpp"
#include "corpc/core/this_call.hpp"
#include "corpc/core/trace.hpp"
#include "corpc/core/when_all.hpp"
#include "corpc/memory/host_memory.hpp"
#include "corpc/rpc/call.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/launch.hpp"
#include "corpc/rpc/runtime.hpp"
