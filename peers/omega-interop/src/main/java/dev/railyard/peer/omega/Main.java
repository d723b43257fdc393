package dev.railyard.peer.omega;

import org.springframework.boot.SpringApplication;
import org.springframework.boot.autoconfigure.SpringBootApplication;
import org.springframework.context.ConfigurableApplicationContext;

/**
 * The Omega interop peer: a minimal Spring Boot service on the real Omega 0.7.1 saga client.
 *
 * <p>Spring Boot reads every option from the command line ({@code --name=value}) or from system
 * properties ({@code -Dname=value}); see README.md. {@link SagaRunner} runs the sagas once the
 * context (and with it Omega's connection to the coordinator) is up and prints
 * {@code RESULT {json}}; then the process exits.
 */
@SpringBootApplication
public class Main {

  public static void main(String[] args) {
    SpringApplication app = new SpringApplication(Main.class);
    // Omega registers its own shutdown hook (OnDisconnected, then closing its channels). Spring's
    // hook would close the context, and Omega's channels with it, at the same moment; without it
    // Omega says goodbye to the coordinator on open channels.
    app.setRegisterShutdownHook(false);
    ConfigurableApplicationContext context = app.run(args);
    System.exit(context.getBean(SagaRunner.class).getExitCode());
  }
}
