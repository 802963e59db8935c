// CartPole: a pole hinged on a cart that moves along a track (Barto, Sutton and Anderson, 1983), with the constants
// and termination rules of Gym's CartPole-v1: 20 ms Euler steps, a force of ±10 N, the episode ends when the pole
// leans beyond 12 degrees or the cart leaves ±2.4 m, or after `max_steps`; every step until then earns 1.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <random>

namespace systems::rl {

class CartPole {
 public:
  using State = std::array<float, 4>;  // cart position, cart velocity, pole angle, pole angular velocity

  explicit CartPole(std::uint64_t seed, int max_steps = 500) : rng_(seed), max_steps_(max_steps) {}

  State reset() {
    std::uniform_real_distribution<double> start(-0.05, 0.05);
    x_ = start(rng_), x_dot_ = start(rng_), theta_ = start(rng_), theta_dot_ = start(rng_);
    steps_ = 0;
    return state();
  }

  struct Step {
    State state;
    float reward;
    bool done;
  };

  // action 0 pushes left, 1 pushes right.
  Step step(int action) {
    constexpr double g = 9.8, cart_mass = 1.0, pole_mass = 0.1, half_length = 0.5, force_mag = 10.0, tau = 0.02;
    constexpr double total_mass = cart_mass + pole_mass, pole_moment = pole_mass * half_length;
    constexpr double pi = 3.14159265358979323846, max_angle = 12 * 2 * pi / 360, max_x = 2.4;
    const double force = action == 1 ? force_mag : -force_mag;
    const double c = std::cos(theta_), s = std::sin(theta_);
    const double temp = (force + pole_moment * theta_dot_ * theta_dot_ * s) / total_mass;
    const double theta_acc = (g * s - c * temp) / (half_length * (4.0 / 3.0 - pole_mass * c * c / total_mass));
    const double x_acc = temp - pole_moment * theta_acc * c / total_mass;
    x_ += tau * x_dot_;
    x_dot_ += tau * x_acc;
    theta_ += tau * theta_dot_;
    theta_dot_ += tau * theta_acc;
    ++steps_;
    const bool fell = std::abs(x_) > max_x || std::abs(theta_) > max_angle;
    return {state(), 1.0f, fell || steps_ >= max_steps_};
  }

 private:
  State state() const {
    return {static_cast<float>(x_), static_cast<float>(x_dot_), static_cast<float>(theta_),
            static_cast<float>(theta_dot_)};
  }

  std::mt19937_64 rng_;
  int max_steps_;
  int steps_ = 0;
  double x_ = 0, x_dot_ = 0, theta_ = 0, theta_dot_ = 0;
};

}  // namespace systems::rl
