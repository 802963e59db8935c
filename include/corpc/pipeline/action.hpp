/// @file
/// One step of a worker's pipeline schedule: compute a forward or a backward for one micro-batch on one stage.
#pragma once

#include <cstdint>
#include <ostream>

#include "corpc/wire/codec.hpp"

namespace corpc::pipeline {

/// Forward; Backward (input and weights together); BackwardInput and BackwardWeight (zero bubble).
enum class ActionKind : std::uint8_t { Forward, Backward, BackwardInput, BackwardWeight };

/// 'F', 'B', 'I' or 'W', as timelines and PyTorch's schedule files label actions.
inline char action_letter(ActionKind k) {
  switch (k) {
    case ActionKind::Forward: return 'F';
    case ActionKind::Backward: return 'B';
    case ActionKind::BackwardInput: return 'I';
    case ActionKind::BackwardWeight: return 'W';
  }
  return '?';
}

/// One step of a worker's action list: compute `kind` for micro-batch `micro` on stage `stage`.
struct Action {
  ActionKind kind = ActionKind::Forward;  ///< what to compute
  std::int32_t stage = 0;                 ///< global stage index
  std::int32_t micro = 0;                 ///< micro-batch index
  /// A forward that runs together with the backward after it (DualPipeV's overlapped F and B): the two start in
  /// whichever order their inputs arrive, so that one's wait for a transfer is the other's compute.
  bool overlap = false;
  bool operator==(const Action&) const = default;  ///< field by field
  CORPC_FIELDS(kind, stage, micro, overlap)
};

/// "2F0": stage, action letter, micro-batch, as PyTorch's schedule files write it ("+" marks an overlapped forward).
inline std::ostream& operator<<(std::ostream& os, const Action& a) {
  return os << a.stage << action_letter(a.kind) << a.micro << (a.overlap ? "+" : "");
}

}  // namespace corpc::pipeline
