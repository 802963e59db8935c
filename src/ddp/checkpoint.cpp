// save_checkpoint / load_checkpoint (see corpc/ddp/checkpoint.hpp). One archive: "model/..." and "optimizer/...".
#include "corpc/ddp/checkpoint.hpp"

#include <cstdio>

#include "corpc/rpc/errors.hpp"

namespace corpc::ddp {

void save_checkpoint(torch::nn::Module& module, torch::optim::Optimizer* optimizer, const std::string& path,
                     c10d::ProcessGroup& group) {
  if (group.getRank() == 0) {
    torch::serialize::OutputArchive archive, model, optim;
    module.save(model);
    archive.write("model", model);
    if (optimizer != nullptr) {
      optimizer->save(optim);
      archive.write("optimizer", optim);
    }
    // Write aside and rename: a rank that dies mid-save never leaves a torn checkpoint behind.
    const std::string tmp = path + ".tmp";
    archive.save_to(tmp);
    if (std::rename(tmp.c_str(), path.c_str()) != 0) throw RpcError("save_checkpoint: cannot rename " + tmp);
  }
  group.barrier()->wait();
}

void load_checkpoint(torch::nn::Module& module, torch::optim::Optimizer* optimizer, const std::string& path,
                     std::optional<torch::Device> device) {
  torch::serialize::InputArchive archive, model, optim;
  archive.load_from(path, device ? c10::optional<torch::Device>(*device) : c10::nullopt);
  archive.read("model", model);
  module.load(model);
  if (optimizer != nullptr) {
    archive.read("optimizer", optim);
    optimizer->load(optim);
  }
}

}  // namespace corpc::ddp
