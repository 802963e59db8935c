// corpc — C++20 coroutine RPC for libtorch. One include for everything.
#pragma once

#include "corpc/core/errors.hpp"
#include "corpc/core/future.hpp"
#include "corpc/core/sync_wait.hpp"
#include "corpc/core/task.hpp"
#include "corpc/core/when_all.hpp"
#include "corpc/rpc/call.hpp"
#include "corpc/rpc/runtime.hpp"
#include "corpc/rpc/spawn.hpp"
