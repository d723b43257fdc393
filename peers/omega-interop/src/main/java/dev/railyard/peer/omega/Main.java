package dev.railyard.peer.omega;

import org.springframework.boot.SpringApplication;
import org.springframework.boot.autoconfigure.SpringBootApplication;

/**
 * The Omega interop peer: a minimal Spring Boot service on the real Omega 0.7.1 saga client.
 *
 * <p>Spring Boot reads every option from the command line ({@code --name=value}) or from system
 * properties ({@code -Dname=value}); see README.md. {@link SagaRunner} runs the sagas once the
 * context (and with it Omega's connection to the coordinator) is up, prints {@code RESULT {json}}
 * and ends the process.
 */
@SpringBootApplication
public class Main {

  public static void main(String[] args) {
    SpringApplication app = new SpringApplication(Main.class);
    System.exit(SpringApplication.exit(app.run(args)));
  }
}
